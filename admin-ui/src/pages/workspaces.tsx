// A tenant's workspaces: each has its own cache (no workspace reads another's), its own keys,
// limits on top of the tenant's, and its own usage.

import { useState } from "preact/hooks";
import { api } from "../api";
import { Confirm, Dialog, Field, FormFooter, Loaded, Notice, Table, useAction, useAsync } from "../components/ui";
import { formatLimit, formatMoney, formatTime } from "../format";
import { minorToText, parseLimit, parseMoney, parseTags, tagsText } from "../forms";
import type { BudgetView, Limits, Tenant, Workspace } from "../types";

const LIMITS: [Exclude<keyof Limits, "monthly_budget_minor">, string, number][] = [
  ["requests_per_minute", "Requests per minute", 1],
  ["input_tokens_per_minute", "Uncached input tokens per minute", 1],
  ["output_tokens_per_minute", "Output tokens per minute", 1],
];

/** The workspaces of a tenant, for pickers and names. */
export function useWorkspaces(tenant: Tenant, includeArchived = false) {
  return useAsync(
    () => api<{ data: Workspace[] }>("GET", `/v1/admin/tenants/${tenant.id}/workspaces?include_archived=${includeArchived}`),
    [tenant.id, includeArchived],
  );
}

function limitText(v: number | null): string {
  return v === null ? "—" : formatLimit(v);
}

export function WorkspacesTab({ tenant, canEdit }: { tenant: Tenant; canEdit: boolean }) {
  const list = useWorkspaces(tenant, true);
  // Budgets are in the tenant's price currency (the budget view says which).
  const budget = useAsync(() => api<BudgetView>("GET", `/v1/admin/tenants/${tenant.id}/budget`), [tenant.id]);
  const currency = budget.data?.currency ?? "USD";
  const [editing, setEditing] = useState<Workspace | "new" | null>(null);
  const [archiving, setArchiving] = useState<Workspace | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const live = tenant.state !== "deleted" && canEdit;
  return (
    <section aria-labelledby="ws-title">
      <h2 id="ws-title">Workspaces</h2>
      <p>
        Each workspace has its own cache (no workspace reads another's), its own keys, and limits on top of the tenant's. Keys
        created without a workspace go to <code>default</code>.
      </p>
      {live && (
        <button type="button" onClick={() => setEditing("new")}>
          Create workspace
        </button>
      )}
      <Notice text={notice} />
      <Loaded state={list} what="workspaces">
        <Table
          caption="Workspaces and their limits (— is none beyond the tenant's)"
          columns={["Name", "State", "Active keys", ...LIMITS.map(([, label]) => label), "Monthly budget", "Created", "Actions"]}
          rows={list.data?.data ?? []}
          row={(w) => (
            <tr key={w.id} data-workspace={w.name}>
              <td>
                {w.name}
                {w.is_default && <small> (default)</small>}
              </td>
              <td class={w.archived_at ? "state-revoked" : "state-active"}>{w.archived_at ? "archived" : "active"}</td>
              <td>{w.active_keys}</td>
              {LIMITS.map(([k]) => (
                <td key={k}>{limitText(w.limits[k])}</td>
              ))}
              <td>{w.limits.monthly_budget_minor === null ? "—" : formatMoney(w.limits.monthly_budget_minor, currency)}</td>
              <td>{formatTime(w.created_at)}</td>
              <td>
                {live && !w.archived_at && (
                  <div class="actions">
                    <button type="button" class="secondary" onClick={() => setEditing(w)} aria-label={`Edit ${w.name}`}>
                      Edit
                    </button>
                    {!w.is_default && (
                      <button type="button" class="danger" onClick={() => setArchiving(w)} aria-label={`Archive ${w.name}`}>
                        Archive
                      </button>
                    )}
                  </div>
                )}
              </td>
            </tr>
          )}
        />
      </Loaded>
      <WorkspaceDialog
        tenant={tenant}
        currency={currency}
        workspace={editing}
        onClose={() => setEditing(null)}
        onSaved={(w) => {
          setEditing(null);
          list.reload();
          setNotice(`Workspace ${w.name} saved.`);
        }}
      />
      <Confirm
        open={archiving !== null}
        title={`Archive ${archiving?.name ?? ""}?`}
        body={<p>Its {archiving?.active_keys ?? 0} active keys are revoked within seconds. Its usage is kept. This cannot be undone.</p>}
        action="Archive"
        danger
        onClose={() => setArchiving(null)}
        onConfirm={async () => {
          await api("POST", `/v1/admin/tenants/${tenant.id}/workspaces/${archiving!.id}/archive`);
          list.reload();
          setNotice(`Workspace ${archiving!.name} archived.`);
        }}
      />
    </section>
  );
}

function WorkspaceDialog(props: {
  tenant: Tenant;
  currency: string;
  workspace: Workspace | "new" | null;
  onClose: () => void;
  onSaved: (w: Workspace) => void;
}) {
  const w = props.workspace;
  const existing = w !== null && w !== "new" ? w : null;
  const initial = () => {
    const f: Record<string, string> = { name: existing?.name ?? "" };
    for (const [k] of LIMITS) f[k] = existing?.limits[k] == null ? "" : String(existing.limits[k]);
    const b = existing?.limits.monthly_budget_minor;
    f.budget = b == null ? "" : minorToText(b, props.currency);
    f.tags = tagsText(existing?.tags);
    return f;
  };
  const [form, setForm] = useState<Record<string, string>>(initial);
  const [errors, setErrors] = useState<Record<string, string>>({});
  const { busy, error, setError, run } = useAction();
  const key = existing?.id ?? (w === "new" ? "new" : "none");
  const [shownFor, setShownFor] = useState(key);
  if (shownFor !== key) {
    setShownFor(key);
    setForm(initial());
    setErrors({});
    setError(null);
  }
  return (
    <Dialog open={w !== null} title={existing ? `Edit ${existing.name}` : "Create a workspace"} onClose={props.onClose}>
      <form
        onSubmit={async (e) => {
          e.preventDefault();
          const errs: Record<string, string> = {};
          const body: Record<string, unknown> = {};
          const name = form.name.trim();
          if (!name) errs.name = "a name of 1 to 200 characters";
          if (!existing?.is_default) body.name = name;
          for (const [k, , min] of LIMITS) {
            const v = parseLimit(form[k], min);
            if (typeof v === "string") errs[k] = v;
            else body[k] = v;
          }
          if (form.budget.trim() === "") body.monthly_budget_minor = null;
          else {
            const v = parseMoney(form.budget, props.currency);
            if (typeof v === "string") errs.budget = v;
            else body.monthly_budget_minor = v;
          }
          const tags = parseTags(form.tags);
          if (typeof tags === "string") errs.tags = tags;
          else body.tags = tags;
          setErrors(errs);
          if (Object.keys(errs).length > 0) return;
          await run(async () => {
            const base = `/v1/admin/tenants/${props.tenant.id}/workspaces`;
            const saved = existing
              ? await api<Workspace>("PATCH", `${base}/${existing.id}`, body)
              : await api<Workspace>("POST", base, body);
            props.onSaved(saved);
          });
        }}
      >
        <Field
          id="ws-name"
          label="Name"
          value={form.name}
          disabled={existing?.is_default}
          hint={existing?.is_default ? "The default workspace keeps its name." : undefined}
          error={errors.name}
          onInput={(e) => setForm({ ...form, name: e.currentTarget.value })}
        />
        {LIMITS.map(([k, label]) => (
          <Field
            key={k}
            id={`ws-${k}`}
            label={label}
            inputMode="numeric"
            placeholder="no limit"
            value={form[k]}
            error={errors[k]}
            onInput={(e) => setForm({ ...form, [k]: e.currentTarget.value })}
          />
        ))}
        <Field
          id="ws-budget"
          label={`Monthly budget (${props.currency}, empty = none)`}
          inputMode="decimal"
          placeholder="no budget"
          value={form.budget}
          error={errors.budget}
          hint="This workspace's keys are refused (429) once its spend this month reaches it."
          onInput={(e) => setForm({ ...form, budget: e.currentTarget.value })}
        />
        <Field
          id="ws-tags"
          label="Tags (tag=value, comma-separated)"
          placeholder="team=search, cost-center=42"
          value={form.tags}
          error={errors.tags}
          hint="Its keys' usage carries them (a key's own tags on top): exports and the dashboard group by them."
          onInput={(e) => setForm({ ...form, tags: e.currentTarget.value })}
        />
        <FormFooter error={error} busy={busy} submit="Save" onCancel={props.onClose} />
      </form>
    </Dialog>
  );
}
