import { useEffect, useState } from "preact/hooks";
import { api, type Me } from "../api";
import { ErrorBanner, Field, Loading, Notice, useAction, useAsync } from "../components/ui";
import { formatBytes } from "../format";
import { CEILING_FIELDS, ceilingText, LIMIT_FIELDS, type Policy, type PolicyForm, policyForm, policyPatch } from "../forms";
import type { BudgetView, Tenant } from "../types";

const CEILING_LABELS: Record<string, string> = {
  requests_per_minute: "Requests per minute",
  input_tokens_per_minute: "Uncached input tokens per minute",
  output_tokens_per_minute: "Output tokens per minute",
  max_cache_ttl_secs: "Longest cache object TTL, seconds",
  max_concurrent: "Generations at once per model",
};

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
  const ceilingHint = (k: string) => (CEILING_FIELDS as readonly string[]).includes(k) ? ceilingText(p.ceilings, k as (typeof CEILING_FIELDS)[number], currency) : undefined;
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
          {LIMIT_FIELDS.map(([k, label]) => field(k, label, { hint: ceilingHint(k) }))}
        </div>
      </fieldset>
      <fieldset disabled={!editable}>
        <legend>Monthly spend budget</legend>
        <div class="row">
          {field("monthly_budget", `Budget (${currency}, empty = none)`, {
            inputMode: "decimal",
            hint: ["Requests are refused (429) once this month's spend reaches it.", ceilingHint("monthly_budget_minor")].filter(Boolean).join(" "),
          })}
          {field("budget_alert_percent", "Alert at (% of the budget)")}
        </div>
      </fieldset>
      <fieldset disabled={!editable}>
        <legend>Cache</legend>
        <label>
          <input
            type="checkbox"
            role="switch"
            id="allow_1h_ttl"
            checked={Boolean(form.allow_1h_ttl)}
            disabled={!platform && !p.ceilings.allow_1h_ttl}
            aria-describedby={errors.allow_1h_ttl ? "allow_1h_ttl-error" : undefined}
            onChange={set("allow_1h_ttl")}
          />
          Allow 1-hour cache TTLs (billed at 2× input for writes)
        </label>
        {!p.ceilings.allow_1h_ttl && <small>The platform does not allow 1-hour TTLs for this tenant.</small>}
        {errors.allow_1h_ttl && (
          <small id="allow_1h_ttl-error" class="field-error">
            {errors.allow_1h_ttl}
          </small>
        )}
        <div class="row">
          {field("max_cache_ttl_secs", "Longest cache object TTL, seconds (300–2592000)", {
            hint: ["How long cache objects (POST /v1/caches) and OpenAI's 24h retention may be held.", ceilingHint("max_cache_ttl_secs")].filter(Boolean).join(" "),
          })}
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
          {field("max_concurrent", "Generations at once per model (empty = no limit)", { hint: ceilingHint("max_concurrent") })}
          {field("engine_weight", "Weight in the fair queue (1–100)", { disabled: !platform, hint: "While tenants wait for a model's workers, each gets turns in proportion to its weight." })}
        </div>
      </fieldset>
      {platform && (
        <fieldset disabled={!editable}>
          <legend>Ceilings (platform admins only)</legend>
          <p>
            <small>
              The tenant's admins may lower each value above within its ceiling, never raise it. Lowering a ceiling lowers a value above it at once (and no
              limit becomes the ceiling); workspaces and keys above the tenant's new limits are lowered with it.
            </small>
          </p>
          <div class="row">
            {CEILING_FIELDS.filter((k) => k !== "monthly_budget_minor").map((k) =>
              field(`ceiling_${k}`, `${CEILING_LABELS[k]} (empty = no ceiling)`),
            )}
            {field("ceiling_monthly_budget_minor", `Monthly budget (${currency}, empty = no ceiling)`, { inputMode: "decimal" })}
          </div>
          <label>
            <input type="checkbox" role="switch" id="ceiling_allow_1h_ttl" checked={Boolean(form.ceiling_allow_1h_ttl)} onChange={set("ceiling_allow_1h_ttl")} />
            The tenant may allow 1-hour cache TTLs
          </label>
        </fieldset>
      )}
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
