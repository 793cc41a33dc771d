import { useEffect, useState } from "preact/hooks";
import { api, type Me } from "../api";
import { ErrorBanner, Field, Loading, Notice, useAction, useAsync } from "../components/ui";
import { formatBytes } from "../format";
import { LIMIT_FIELDS, type Policy, type PolicyForm, policyForm, policyPatch } from "../forms";
import type { BudgetView, Tenant } from "../types";

export function PolicyTab({ me, tenant }: { me: Me; tenant: Tenant }) {
  const policy = useAsync(
    async () => {
      const [p, b] = await Promise.all([
        api<Policy>("GET", `/v1/admin/tenants/${tenant.id}/policy`),
        api<BudgetView>("GET", `/v1/admin/tenants/${tenant.id}/budget`),
      ]);
      return { p, currency: b.currency };
    },
    [tenant.id],
  );
  // Null until filled from the loaded policy: the fields show only then, so nothing typed
  // in the first moments is overwritten when the loaded values arrive.
  const [form, setForm] = useState<PolicyForm | null>(null);
  const [errors, setErrors] = useState<Record<string, string>>({});
  const [notice, setNotice] = useState<string | null>(null);
  const { busy, error, setError, run } = useAction();
  useEffect(() => {
    if (policy.data) setForm(policyForm(policy.data.p, policy.data.currency));
  }, [policy.data]);
  if (policy.error) return <ErrorBanner error={policy.error} />;
  if (!policy.data || !form) return <Loading what="the policy" />;
  const { p, currency } = policy.data;
  const platform = me.role === "platform_admin";
  const editable = me.role !== "finance" && tenant.state !== "deleted";
  const set = (k: string) => (e: { currentTarget: HTMLInputElement }) =>
    setForm({ ...form, [k]: e.currentTarget.type === "checkbox" ? e.currentTarget.checked : e.currentTarget.value });
  // A field bound to its key of the form: value, error and input (numeric unless `more` says).
  const field = (k: keyof PolicyForm & string, label: string, more: Partial<Parameters<typeof Field>[0]> = {}) => (
    <Field key={k} id={k} label={label} inputMode="numeric" value={String(form[k] ?? "")} error={errors[k]} onInput={set(k)} {...more} />
  );
  return (
    <form
      aria-labelledby="policy-title"
      noValidate
      onSubmit={async (e) => {
        e.preventDefault();
        const { patch, errors } = policyPatch(p, form, currency, platform);
        setErrors(errors);
        setNotice(null);
        if (Object.keys(errors).length) {
          setError("Fix the fields marked below.");
          return;
        }
        if (Object.keys(patch).length === 0) {
          setError(null);
          setNotice("Nothing changed.");
          return;
        }
        await run(async () => {
          const next = await api<Policy>("PATCH", `/v1/admin/tenants/${tenant.id}/policy`, patch);
          policy.setData({ p: next, currency });
          setNotice("Saved. Running gateways apply it within seconds.");
        });
      }}
    >
      <h2 id="policy-title">Quotas and policy</h2>
      <fieldset disabled={!editable}>
        <legend>Rate limits (empty = no limit)</legend>
        <div class="row">
          {LIMIT_FIELDS.map(([k, label]) => field(k, label))}
        </div>
      </fieldset>
      <fieldset disabled={!editable}>
        <legend>Monthly spend budget</legend>
        <div class="row">
          {field("monthly_budget", `Budget (${currency}, empty = none)`, { inputMode: "decimal", hint: "Requests are refused (429) once this month's spend reaches it." })}
          {field("budget_alert_percent", "Alert at (% of the budget)")}
        </div>
      </fieldset>
      <fieldset disabled={!editable}>
        <legend>Cache</legend>
        <label>
          <input type="checkbox" role="switch" id="allow_1h_ttl" checked={Boolean(form.allow_1h_ttl)} onChange={set("allow_1h_ttl")} />
          Allow 1-hour cache TTLs (billed at 2× input for writes)
        </label>
        <div class="row">
          {field("max_cache_ttl_secs", "Longest cache object TTL, seconds (300–2592000)", { hint: "How long cache objects (POST /v1/caches) and OpenAI's 24h retention may be held." })}
        </div>
        <div class="row">
          {field("cache_resident_bytes", "Resident cache bytes (empty = no limit)", { disabled: !platform, hint: p.cache_resident_bytes !== null ? formatBytes(p.cache_resident_bytes) : undefined })}
          {field("reserved_cache_bytes", "Reserved cache bytes (billed)", { disabled: !platform, hint: p.reserved_cache_bytes !== null ? formatBytes(p.reserved_cache_bytes) : undefined })}
          {field("replication_factor", "Replication factor (empty = cluster default)", { disabled: !platform })}
        </div>
        {!platform && <small>Cache capacity and replication are set by the platform's administrators.</small>}
      </fieldset>
      <fieldset disabled={!editable}>
        <legend>Engine share</legend>
        <div class="row">
          {field("max_concurrent", "Generations at once per model (empty = no limit)")}
          {field("engine_weight", "Weight in the fair queue (1–100)", { disabled: !platform, hint: "While tenants wait for a model's workers, each gets turns in proportion to its weight." })}
        </div>
      </fieldset>
      <ErrorBanner error={error} />
      <Notice text={notice} />
      {editable && (
        <button type="submit" aria-busy={busy} disabled={busy}>
          Save policy
        </button>
      )}
    </form>
  );
}
