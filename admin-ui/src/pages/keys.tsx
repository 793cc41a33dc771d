import { useState } from "preact/hooks";
import { api } from "../api";
import { Confirm, Dialog, ErrorBanner, Field, FormFooter, Loaded, message, Notice, SecretDialog, Table, useAction, useAsync } from "../components/ui";
import { formatTime } from "../format";
import { KEY_LIMIT_FIELDS, keyLimitsPatch, type Policy, parseGrace, parseTags, tagsText, validateKey } from "../forms";
import type { CreatedKey, Key, Limits, Rotation, Tenant, Workspace } from "../types";
import { useWorkspaces } from "./workspaces";

export function KeysTab({ tenant }: { tenant: Tenant }) {
  const keys = useAsync(() => api<{ data: Key[] }>("GET", `/v1/admin/tenants/${tenant.id}/keys`), [tenant.id]);
  const workspaces = useWorkspaces(tenant, true);
  const wsName = (id: string) => workspaces.data?.data.find((w) => w.id === id)?.name ?? "…";
  const [creating, setCreating] = useState(false);
  const [secret, setSecret] = useState<{ title: string; value: string; note: string } | null>(null);
  const [rotating, setRotating] = useState<Key | null>(null);
  const [revoking, setRevoking] = useState<Key | null>(null);
  const [expiring, setExpiring] = useState<Key | null>(null);
  const [limiting, setLimiting] = useState<Key | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const live = tenant.state !== "deleted";
  return (
    <section aria-labelledby="keys-title">
      <h2 id="keys-title">API keys</h2>
      {live && (
        <button type="button" onClick={() => setCreating(true)}>
          Create key
        </button>
      )}
      <Notice text={notice} />
      <Loaded state={keys} what="keys">
        <Table
          caption="Keys (secrets are never shown again)"
          columns={["Name", "Prefix", "Workspace", "State", "Created", "Last used", "Expires", "Own limits", "Tags", "Actions"]}
          rows={keys.data?.data ?? []} row={(k) => (
            <tr key={k.id} data-key={k.id}>
              <td>{k.name}</td>
              <td>
                <code>{k.prefix}…</code>
              </td>
              <td>{wsName(k.workspace_id)}</td>
              <td class={`state-${k.state}`}>{k.state}</td>
              <td>{formatTime(k.created_at)}</td>
              <td>{formatTime(k.last_used_at)}</td>
              <td>{formatTime(k.expires_at)}</td>
              <td>{ownLimits(k.limits)}</td>
              <td>{tagsText(k.tags) || "–"}</td>
              <td>
                {(k.state === "active" || k.state === "rotating") && (
                  <div class="actions">
                    {k.state === "active" && (
                      <>
                        <button type="button" class="secondary" onClick={() => setRotating(k)} aria-label={`Rotate ${k.name} ${k.prefix}`}>
                          Rotate
                        </button>
                        <button type="button" class="secondary" onClick={() => setExpiring(k)} aria-label={`Set expiry of ${k.name} ${k.prefix}`}>
                          Expiry
                        </button>
                        <button type="button" class="secondary" onClick={() => setLimiting(k)} aria-label={`Set limits and tags of ${k.name} ${k.prefix}`}>
                          Limits & tags
                        </button>
                      </>
                    )}
                    <button type="button" class="danger" onClick={() => setRevoking(k)} aria-label={`Revoke ${k.name} ${k.prefix}`}>
                      Revoke
                    </button>
                  </div>
                )}
              </td>
            </tr>
          )}
        />
      </Loaded>
      <CreateKeyDialog
        open={creating}
        tenant={tenant}
        workspaces={(workspaces.data?.data ?? []).filter((w) => !w.archived_at)}
        onClose={() => setCreating(false)}
        onCreated={(k) => {
          setCreating(false);
          keys.reload();
          setSecret({
            title: `Key "${k.name}" created`,
            value: k.secret ?? "",
            note: "Copy the secret now: it is shown this once and Cachet keeps only its hash.",
          });
        }}
      />
      <RotateDialog
        keyToRotate={rotating}
        tenant={tenant}
        onClose={() => setRotating(null)}
        onRotated={(r) => {
          setRotating(null);
          keys.reload();
          setSecret({
            title: `Key "${r.new_key.name}" rotated`,
            value: r.secret ?? "",
            note: `The old secret keeps working until ${formatTime(r.grace_until)}. Copy the new one now: it is shown this once.`,
          });
        }}
      />
      <ExpiryDialog
        keyToChange={expiring}
        tenant={tenant}
        onClose={() => setExpiring(null)}
        onChanged={() => {
          setExpiring(null);
          keys.reload();
          setNotice("Expiry saved.");
        }}
      />
      <KeyLimitsDialog
        keyToChange={limiting}
        tenant={tenant}
        workspace={workspaces.data?.data.find((w) => w.id === limiting?.workspace_id) ?? null}
        onClose={() => setLimiting(null)}
        onChanged={(k) => {
          setLimiting(null);
          keys.reload();
          setNotice(`Limits and tags of ${k.prefix}… saved. Running gateways apply them within seconds.`);
        }}
      />
      <Confirm
        open={revoking !== null}
        title={`Revoke ${revoking?.name ?? ""}?`}
        body={<p>Requests with {revoking?.prefix}… are refused within seconds. This cannot be undone.</p>}
        action="Revoke"
        danger
        onClose={() => setRevoking(null)}
        onConfirm={async () => {
          await api("POST", `/v1/admin/tenants/${tenant.id}/keys/${revoking!.id}/revoke`);
          keys.reload();
          setNotice(`Key ${revoking!.prefix}… revoked.`);
        }}
      />
      <SecretDialog title={secret?.title ?? ""} secret={secret?.value ?? null} note={secret?.note ?? ""} onClose={() => setSecret(null)} />
    </section>
  );
}

function CreateKeyDialog(props: {
  open: boolean;
  tenant: Tenant;
  workspaces: Workspace[];
  onClose: () => void;
  onCreated: (k: CreatedKey) => void;
}) {
  const [name, setName] = useState("");
  const [workspace, setWorkspace] = useState("");
  const [expires, setExpires] = useState("");
  const [errors, setErrors] = useState<Record<string, string>>({});
  const { busy, error, run } = useAction();
  return (
    <Dialog open={props.open} title="Create an API key" onClose={props.onClose}>
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          const v = validateKey(name, expires);
          setErrors(v.errors);
          if (!v.value) return;
          await run(async () => {
            const body = workspace ? { ...v.value, workspace_id: workspace } : v.value;
            const k = await api<CreatedKey>("POST", `/v1/admin/tenants/${props.tenant.id}/keys`, body);
            setName("");
            setExpires("");
            props.onCreated(k);
          });
        }}
      >
        <Field id="key-name" label="Name" value={name} error={errors.name} onInput={(e) => setName(e.currentTarget.value)} />
        <Field id="key-workspace" label="Workspace" hint="Its cache, limits and usage are the workspace's.">
          <select id="key-workspace" value={workspace} onChange={(e) => setWorkspace(e.currentTarget.value)}>
            {props.workspaces.map((w) => (
              <option key={w.id} value={w.is_default ? "" : w.id}>
                {w.name}
              </option>
            ))}
          </select>
        </Field>
        <Field
          id="key-expires"
          label="Expires (UTC, optional)"
          type="datetime-local"
          value={expires}
          error={errors.expires}
          onInput={(e) => setExpires(e.currentTarget.value)}
        />
        <FormFooter error={error} busy={busy} submit="Create" onCancel={props.onClose} />
      </form>
    </Dialog>
  );
}

function RotateDialog(props: { keyToRotate: Key | null; tenant: Tenant; onClose: () => void; onRotated: (r: Rotation) => void }) {
  const [hours, setHours] = useState("24");
  const [fieldError, setFieldError] = useState<string | undefined>();
  const { busy, error, run } = useAction();
  // One idempotency key per dialog: a retry after a lost answer returns the same new key.
  const [idem, setIdem] = useState(() => crypto.randomUUID());
  const k = props.keyToRotate;
  return (
    <Dialog open={k !== null} title={`Rotate ${k?.name ?? ""} (${k?.prefix ?? ""}…)`} onClose={props.onClose}>
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          const grace = parseGrace(hours);
          setFieldError(typeof grace === "string" ? grace : undefined);
          if (typeof grace === "string" || !k) return;
          await run(async () => {
            const r = await api<Rotation>(
              "POST",
              `/v1/admin/tenants/${props.tenant.id}/keys/${k.id}/rotate`,
              { grace_seconds: grace },
              { "idempotency-key": idem },
            );
            setIdem(crypto.randomUUID());
            props.onRotated(r);
          }, (err) => `${message(err)} — retrying is safe: it returns the same new key.`);
        }}
      >
        <p>A new key with the same name is made now. The old secret keeps working for the grace period, then stops.</p>
        <Field
          id="grace-hours"
          label="Grace period (hours)"
          inputMode="decimal"
          value={hours}
          error={fieldError}
          onInput={(e) => setHours(e.currentTarget.value)}
        />
        <FormFooter error={error} busy={busy} submit="Rotate" onCancel={props.onClose} />
      </form>
    </Dialog>
  );
}

function ExpiryDialog(props: { keyToChange: Key | null; tenant: Tenant; onClose: () => void; onChanged: () => void }) {
  const [expires, setExpires] = useState("");
  const [fieldError, setFieldError] = useState<string | undefined>();
  const [error, setError] = useState<string | null>(null);
  const k = props.keyToChange;
  const save = async (expires_at: string | null) => {
    try {
      await api("PATCH", `/v1/admin/tenants/${props.tenant.id}/keys/${k!.id}`, { expires_at });
      setError(null);
      props.onChanged();
    } catch (err) {
      setError(message(err));
    }
  };
  return (
    <Dialog open={k !== null} title={`Expiry of ${k?.name ?? ""} (${k?.prefix ?? ""}…)`} onClose={props.onClose}>
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          const v = validateKey(k?.name ?? "x", expires);
          setFieldError(v.errors.expires ?? (expires ? undefined : "choose a date and time"));
          if (!v.value || !expires) return;
          await save(v.value.expires_at);
        }}
      >
        <p>Now: {k?.expires_at ? formatTime(k.expires_at) : "never expires"}.</p>
        <Field
          id="key-expiry"
          label="Expires (UTC)"
          type="datetime-local"
          value={expires}
          error={fieldError}
          onInput={(e) => setExpires(e.currentTarget.value)}
        />
        <ErrorBanner error={error} />
        <footer>
          <button type="button" class="secondary" onClick={() => save(null)}>
            Never expire
          </button>
          <button type="submit">Save</button>
        </footer>
      </form>
    </Dialog>
  );
}

/** A key's own limits in a table cell: "60 req/min · 10,000 in/min", or the default. */
function ownLimits(l: Limits): string {
  const parts = [
    l.requests_per_minute !== null ? `${l.requests_per_minute.toLocaleString("en-US")} req/min` : "",
    l.input_tokens_per_minute !== null ? `${l.input_tokens_per_minute.toLocaleString("en-US")} in/min` : "",
    l.output_tokens_per_minute !== null ? `${l.output_tokens_per_minute.toLocaleString("en-US")} out/min` : "",
  ].filter(Boolean);
  return parts.length ? parts.join(" · ") : "tenant default";
}

function KeyLimitsDialog(props: {
  keyToChange: Key | null;
  tenant: Tenant;
  workspace: Workspace | null;
  onClose: () => void;
  onChanged: (k: Key) => void;
}) {
  const k = props.keyToChange;
  const policy = useAsync(
    async () => (k ? api<Policy>("GET", `/v1/admin/tenants/${props.tenant.id}/policy`) : null),
    [props.tenant.id, k?.id],
  );
  const [form, setForm] = useState<Record<string, string>>({});
  const [errors, setErrors] = useState<Record<string, string>>({});
  const { busy, error, setError, run } = useAction();
  const [shownFor, setShownFor] = useState<string | null>(null);
  if (k && shownFor !== k.id) {
    setShownFor(k.id);
    setErrors({});
    setError(null);
    setForm({
      ...Object.fromEntries(KEY_LIMIT_FIELDS.map(([f]) => [f, k.limits[f] === null ? "" : String(k.limits[f])])),
      tags: tagsText(k.tags),
    });
  }
  const none: Limits = { requests_per_minute: null, input_tokens_per_minute: null, output_tokens_per_minute: null, monthly_budget_minor: null };
  const ws = props.workspace?.limits ?? none;
  const p = policy.data ?? null;
  const hint = (f: (typeof KEY_LIMIT_FIELDS)[number][0]) => {
    const def = p ? p[`key_${f}` as keyof Policy] : null;
    const bounds = [
      ws[f] !== null ? `workspace ${ws[f]!.toLocaleString("en-US")}` : "",
      p && p[f] !== null ? `tenant ${p[f]!.toLocaleString("en-US")}` : "",
    ].filter(Boolean);
    return [
      `Empty: the tenant's per-key default (${def === null || def === undefined ? "none" : Number(def).toLocaleString("en-US")}).`,
      bounds.length ? `At most ${bounds.join(", ")}.` : "",
    ]
      .filter(Boolean)
      .join(" ");
  };
  return (
    <Dialog open={k !== null} title={`Limits and tags of ${k?.name ?? ""} (${k?.prefix ?? ""}…)`} onClose={props.onClose}>
      <form
        noValidate
        onSubmit={async (e) => {
          e.preventDefault();
          if (!k) return;
          const v = keyLimitsPatch(k.limits, form, ws, p ?? none);
          const tags = parseTags(form.tags ?? "");
          const errs: Record<string, string> = { ...v.errors };
          const patch: Record<string, unknown> = { ...v.patch };
          if (typeof tags === "string") errs.tags = tags;
          else if (tagsText(tags) !== tagsText(k.tags)) patch.tags = tags;
          setErrors(errs);
          if (Object.keys(errs).length) return;
          if (Object.keys(patch).length === 0) {
            props.onClose();
            return;
          }
          await run(async () => {
            props.onChanged(await api<Key>("PATCH", `/v1/admin/tenants/${props.tenant.id}/keys/${k.id}`, patch));
          });
        }}
      >
        <p>This key's own rate limits, on top of its workspace's and the tenant's. A key has no budget of its own.</p>
        {KEY_LIMIT_FIELDS.map(([f, label]) => (
          <Field
            key={f}
            id={`key-${f}`}
            label={label}
            inputMode="numeric"
            value={form[f] ?? ""}
            error={errors[f]}
            hint={hint(f)}
            onInput={(e) => setForm({ ...form, [f]: e.currentTarget.value })}
          />
        ))}
        <Field
          id="key-tags"
          label="Tags (tag=value, comma-separated)"
          placeholder="team=search, env=prod"
          value={form.tags ?? ""}
          error={errors.tags}
          hint={`On top of its workspace's${props.workspace && tagsText(props.workspace.tags) ? ` (${tagsText(props.workspace.tags)})` : ""}: exports and the dashboard group usage by them.`}
          onInput={(e) => setForm({ ...form, tags: e.currentTarget.value })}
        />
        <FormFooter error={error} busy={busy} submit="Save" onCancel={props.onClose} />
      </form>
    </Dialog>
  );
}
