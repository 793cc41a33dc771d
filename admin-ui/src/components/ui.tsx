// Small building blocks shared by the pages: labelled fields, errors, dialogs, loading.

import type { ComponentChildren, PartialInputHTMLAttributes } from "preact";
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "../api";

/** Run `load` on mount and when `deps` change; `reload` runs it again. */
export function useAsync<T>(load: () => Promise<T>, deps: unknown[]) {
  const [data, setData] = useState<T | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [loading, setLoading] = useState(true);
  const run = useCallback(async () => {
    setLoading(true);
    try {
      setData(await load());
      setError(null);
    } catch (e) {
      setError(message(e));
    } finally {
      setLoading(false);
    }
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, deps);
  useEffect(() => {
    run();
  }, [run]);
  return { data, error, loading, reload: run, setData };
}

/** A form's action: `run(act)` is busy while `act` runs, and shows what it threw (through
 * `describe`) or clears the error once it succeeds. */
export function useAction() {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);
  const run = async (act: () => Promise<void>, describe: (e: unknown) => string = message) => {
    setBusy(true);
    try {
      await act();
      setError(null);
    } catch (e) {
      setError(describe(e));
    } finally {
      setBusy(false);
    }
  };
  return { busy, error, setError, run };
}

export function message(e: unknown): string {
  if (e instanceof ApiError) return e.message;
  if (e instanceof Error) return e.message;
  return String(e);
}

/** A `useAsync` load on a page: its error, "Loading …" until its first data, then `children`. */
export function Loaded(props: {
  state: { error: string | null; loading: boolean; data: unknown };
  what: string;
  children: ComponentChildren;
}) {
  const { state, what, children } = props;
  return (
    <>
      <ErrorBanner error={state.error} />
      {state.loading && !state.data ? <Loading what={what} /> : children}
    </>
  );
}

export function ErrorBanner({ error }: { error: string | null | undefined }) {
  if (!error) return null;
  return (
    <p role="alert" class="error-banner">
      {error}
    </p>
  );
}

export function Notice({ text }: { text: string | null }) {
  return (
    <p role="status" aria-live="polite" class="notice">
      {text ?? ""}
    </p>
  );
}

export function Loading({ what }: { what: string }) {
  return <p aria-busy="true">Loading {what}…</p>;
}

/** A labelled input with its hint and error under it (outside the label, so the input's
 * accessible name is the label alone; they are tied to it by aria-describedby). */
export function Field(props: {
  id: string;
  label: string;
  error?: string;
  hint?: string;
  children?: ComponentChildren;
} & Omit<PartialInputHTMLAttributes<HTMLInputElement>, "label" | "role">) {
  const { id, label, error, hint, children, ...input } = props;
  const described = [error ? `${id}-error` : "", hint ? `${id}-hint` : ""].filter(Boolean).join(" ");
  return (
    <div class="field">
      <label for={id}>{label}</label>
      {children ?? (
        <input
          id={id}
          name={id}
          aria-invalid={error ? "true" : undefined}
          aria-describedby={described || undefined}
          {...(input as Record<string, unknown>)}
        />
      )}
      {hint && <small id={`${id}-hint`}>{hint}</small>}
      {error && (
        <small id={`${id}-error`} class="field-error">
          {error}
        </small>
      )}
    </div>
  );
}

/** A modal dialog (native <dialog>: focus is kept inside, Escape closes it). */
export function Dialog(props: {
  open: boolean;
  title: string;
  onClose: () => void;
  children: ComponentChildren;
}) {
  const ref = useRef<HTMLDialogElement>(null);
  useEffect(() => {
    const d = ref.current;
    if (!d) return;
    if (props.open && !d.open) d.showModal();
    if (!props.open && d.open) d.close();
  }, [props.open]);
  return (
    <dialog ref={ref} aria-labelledby="dialog-title" onClose={props.onClose}>
      <article>
        <header>
          <button type="button" aria-label="Close" class="close" onClick={props.onClose} />
          <h2 id="dialog-title">{props.title}</h2>
        </header>
        {props.open && props.children}
      </article>
    </dialog>
  );
}

/** Ask before doing something that cannot be undone. */
/** A labelled choice of one of `items` (by id, shown by name), or of none (`""`). */
export function Pick(props: {
  id: string;
  label: string;
  value: string;
  none: string;
  items: { id: string; name: string }[];
  onChange: (id: string) => void;
}) {
  return (
    <label for={props.id}>
      {props.label}
      <select id={props.id} value={props.value} onChange={(e) => props.onChange(e.currentTarget.value)}>
        <option value="">{props.none}</option>
        {props.items.map((i) => (
          <option key={i.id} value={i.id}>
            {i.name}
          </option>
        ))}
      </select>
    </label>
  );
}

/** A form dialog's end: its error, Cancel, and the submit button (busy while it runs). */
export function FormFooter(props: { error: string | null; busy: boolean; submit: string; onCancel: () => void }) {
  return (
    <>
      <ErrorBanner error={props.error} />
      <footer>
        <button type="button" class="secondary" onClick={props.onCancel}>
          Cancel
        </button>
        <button type="submit" aria-busy={props.busy} disabled={props.busy}>
          {props.submit}
        </button>
      </footer>
    </>
  );
}

export function Confirm(props: {
  open: boolean;
  title: string;
  body: ComponentChildren;
  action: string;
  danger?: boolean;
  onConfirm: () => Promise<void> | void;
  onClose: () => void;
}) {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);
  return (
    <Dialog open={props.open} title={props.title} onClose={props.onClose}>
      <div>{props.body}</div>
      <ErrorBanner error={error} />
      <footer>
        <button type="button" class="secondary" onClick={props.onClose}>
          Cancel
        </button>
        <button
          type="button"
          class={props.danger ? "danger" : undefined}
          aria-busy={busy}
          disabled={busy}
          onClick={async () => {
            setBusy(true);
            try {
              await props.onConfirm();
              setError(null);
              props.onClose();
            } catch (e) {
              setError(message(e));
            } finally {
              setBusy(false);
            }
          }}
        >
          {props.action}
        </button>
      </footer>
    </Dialog>
  );
}

/** A headline number. */
export function Kpi({ label, value, note }: { label: string; value: string; note?: string }) {
  return (
    <article class="kpi">
      <p class="kpi-label">{label}</p>
      <p class="kpi-value" data-kpi={label}>
        {value}
      </p>
      {note && <p class="kpi-note">{note}</p>}
    </article>
  );
}

/**
 * A captioned table that scrolls sideways on a narrow window instead of breaking the page;
 * `columns` (those not `false`) make its head.
 */
export function Table<R>({
  caption,
  columns,
  rows,
  row,
  empty,
  children,
}: {
  caption: string;
  columns?: (string | false | undefined)[];
  /** The body: a `row` for each of `rows`, or one row saying `empty` when there are none. */
  rows?: R[];
  row?: (r: R) => ComponentChildren;
  empty?: string;
  /** Anything else inside the table (a header of its own, a body built by hand). */
  children?: ComponentChildren;
}) {
  return (
    <div class="table-wrap" role="region" aria-label={caption} tabIndex={0}>
      <table class="striped">
        <caption>{caption}</caption>
        {columns && (
          <thead>
            <tr>
              {columns.map((c) => c && <th scope="col">{c}</th>)}
            </tr>
          </thead>
        )}
        {children}
        {rows && row && (
          <tbody>
            {rows.length === 0 && empty && (
              <tr>
                <td colSpan={columns?.filter(Boolean).length}>{empty}</td>
              </tr>
            )}
            {rows.map(row)}
          </tbody>
        )}
      </table>
    </div>
  );
}

/** Copy text, with a fallback for browsers without clipboard access. */
export async function copy(text: string): Promise<boolean> {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false;
  }
}

/** Shows a secret once, with a copy button; closing it is final. */
export function SecretDialog(props: { title: string; secret: string | null; note: string; onClose: () => void }) {
  const [copied, setCopied] = useState<string | null>(null);
  return (
    <Dialog open={props.secret !== null} title={props.title} onClose={props.onClose}>
      <p>{props.note}</p>
      <p class="secret" data-secret>
        {props.secret}
      </p>
      <Notice text={copied} />
      <footer>
        <button
          type="button"
          class="secondary"
          onClick={async () => setCopied((await copy(props.secret ?? "")) ? "Copied." : "Copy it by hand: the clipboard is not available.")}
        >
          Copy
        </button>
        <button type="button" onClick={props.onClose}>
          I have stored it
        </button>
      </footer>
    </Dialog>
  );
}

/**
 * A password input: `current` for one the user already has (the browser may fill it), `new`
 * for one being chosen (the browser may suggest one).
 */
export function PasswordField(props: {
  id: string;
  label: string;
  kind: "current" | "new";
  value: string;
  error?: string;
  required?: boolean;
  onValue: (v: string) => void;
}) {
  const { kind, onValue, ...field } = props;
  return (
    <Field {...field} type="password" autoComplete={`${kind}-password`} onInput={(e) => onValue(e.currentTarget.value)} />
  );
}

/** A new password typed twice (ids prefixed with `id`), with the errors of `validateNewPassword`. */
export function NewPasswordFields<F extends { password: string; confirm: string }>(props: {
  id: string;
  form: F;
  errors: Record<string, string>;
  onChange: (form: F) => void;
}) {
  const { id, form, errors, onChange } = props;
  return (
    <>
      <PasswordField id={`${id}-password`} label="New password (12+ characters)" kind="new" value={form.password}
        error={errors.password} onValue={(password) => onChange({ ...form, password })} />
      <PasswordField id={`${id}-confirm`} label="New password, again" kind="new" value={form.confirm}
        error={errors.confirm} onValue={(confirm) => onChange({ ...form, confirm })} />
    </>
  );
}
