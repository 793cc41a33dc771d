// Form validation, done before anything is sent (the server checks again and its error text
// is shown as it is). Pure functions: tested in test/forms.test.ts.

import { formatDuration, minorDigits } from "./format";
import type { PriceRates } from "./pricebook";
import type { Limits } from "./types";

export type Errors = Record<string, string>;

/** The platform's ceilings for a tenant (null: none): the tenant's own values stay within. */
export interface Ceilings extends Limits {
  allow_1h_ttl: boolean;
  max_cache_ttl_secs: number | null;
  max_concurrent: number | null;
}

/** A tenant's policy as the API returns it: the tenant's own limits and the rest. */
export interface Policy extends Limits {
  key_requests_per_minute: number | null;
  key_input_tokens_per_minute: number | null;
  key_output_tokens_per_minute: number | null;
  budget_alert_percent: number;
  cache_resident_bytes: number | null;
  reserved_cache_bytes: number | null;
  allow_1h_ttl: boolean;
  replication_factor: number | null;
  engine_weight: number;
  max_concurrent: number | null;
  max_cache_ttl_secs: number;
  ceilings: Ceilings;
}

/** The fields a ceiling bounds, with the word for "none" in an error. */
export const CEILING_FIELDS = [
  "requests_per_minute",
  "input_tokens_per_minute",
  "output_tokens_per_minute",
  "monthly_budget_minor",
  "max_cache_ttl_secs",
  "max_concurrent",
] as const;

/** The rate limits, in form order: [field, label, unit]. */
export const LIMIT_FIELDS: [keyof Policy, string, string][] = [
  ["requests_per_minute", "Requests per minute", "requests"],
  ["input_tokens_per_minute", "Uncached input tokens per minute", "tokens"],
  ["output_tokens_per_minute", "Output tokens per minute", "tokens"],
  ["key_requests_per_minute", "Requests per minute, per key", "requests"],
  ["key_input_tokens_per_minute", "Uncached input tokens per minute, per key", "tokens"],
  ["key_output_tokens_per_minute", "Output tokens per minute, per key", "tokens"],
];

/** Fields only a platform admin may change. */
export const PLATFORM_FIELDS: (keyof Policy)[] = [
  "cache_resident_bytes",
  "reserved_cache_bytes",
  "replication_factor",
  "engine_weight",
];

/** The form's text inputs, keyed by policy field (`monthly_budget` in major units). */
export type PolicyForm = Record<string, string | boolean>;

/** The form's initial values from a policy. */
export function policyForm(p: Policy, currency: string): PolicyForm {
  const f: PolicyForm = {};
  for (const [k] of LIMIT_FIELDS) f[k] = p[k] === null ? "" : String(p[k]);
  f.monthly_budget = p.monthly_budget_minor === null ? "" : minorToText(p.monthly_budget_minor, currency);
  f.budget_alert_percent = String(p.budget_alert_percent);
  f.cache_resident_bytes = p.cache_resident_bytes === null ? "" : String(p.cache_resident_bytes);
  f.reserved_cache_bytes = p.reserved_cache_bytes === null ? "" : String(p.reserved_cache_bytes);
  f.replication_factor = p.replication_factor === null ? "" : String(p.replication_factor);
  f.allow_1h_ttl = p.allow_1h_ttl;
  f.engine_weight = String(p.engine_weight);
  f.max_concurrent = p.max_concurrent === null ? "" : String(p.max_concurrent);
  f.max_cache_ttl_secs = String(p.max_cache_ttl_secs);
  const c = p.ceilings;
  for (const k of CEILING_FIELDS) {
    const v = c[k];
    f[`ceiling_${k}`] = v === null ? "" : k === "monthly_budget_minor" ? minorToText(v, currency) : String(v);
  }
  f.ceiling_allow_1h_ttl = c.allow_1h_ttl;
  return f;
}

/** A ceiling as the form shows it beside its field ("at most 600", "at most 20.00 USD"). */
export function ceilingText(c: Ceilings, k: (typeof CEILING_FIELDS)[number], currency: string): string | undefined {
  const v = c[k];
  if (v === null) return undefined;
  const shown = k === "monthly_budget_minor" ? `${minorToText(v, currency)} ${currency}` : v.toLocaleString("en-US");
  return `Ceiling set by the platform: at most ${shown}.`;
}

/**
 * What a tenant admin's values would break of the platform's ceilings, per form field: more
 * than a ceiling, or no limit under one (the server refuses both).
 */
export function ceilingErrors(next: Partial<Policy>, c: Ceilings, currency: string): Errors {
  const errors: Errors = {};
  for (const k of CEILING_FIELDS) {
    const cap = c[k];
    if (cap === null || !(k in next)) continue;
    const v = next[k];
    const field = k === "monthly_budget_minor" ? "monthly_budget" : k;
    const shown = k === "monthly_budget_minor" ? `${minorToText(cap, currency)} ${currency}` : cap.toLocaleString("en-US");
    if (v === null) errors[field] = `the platform's ceiling is ${shown}: enter a value up to it`;
    else if (typeof v === "number" && v > cap) errors[field] = `at most ${shown} (the platform's ceiling)`;
  }
  if (next.allow_1h_ttl && !c.allow_1h_ttl) errors.allow_1h_ttl = "the platform does not allow 1-hour TTLs for this tenant";
  return errors;
}

/** The platform admin's ceilings patch from the form (only changed fields), or errors. */
function ceilingsPatch(current: Ceilings, form: PolicyForm, currency: string): { patch: Partial<Ceilings>; errors: Errors } {
  const errors: Errors = {};
  const next: Partial<Ceilings> = {};
  const text = (k: string) => String(form[`ceiling_${k}`] ?? "").trim();
  for (const k of CEILING_FIELDS) {
    const key = `ceiling_${k}`;
    if (k === "monthly_budget_minor") {
      if (text(k) === "") next[k] = null;
      else {
        const v = parseMoney(text(k), currency);
        if (typeof v === "string") errors[key] = v;
        else next[k] = v;
      }
      continue;
    }
    const v = parseLimit(text(k), k === "max_cache_ttl_secs" ? 300 : 1);
    if (typeof v === "string" || (k === "max_cache_ttl_secs" && typeof v === "number" && v > 2592000)) {
      errors[key] = k === "max_cache_ttl_secs" ? "from 300 to 2592000 seconds, or empty for none" : String(v).replace("no limit", "no ceiling");
    } else next[k] = v;
  }
  next.allow_1h_ttl = Boolean(form.ceiling_allow_1h_ttl);
  const patch: Partial<Ceilings> = {};
  for (const [k, v] of Object.entries(next) as [keyof Ceilings, unknown][]) {
    if (current[k] !== v) (patch as Record<string, unknown>)[k] = v;
  }
  return { patch, errors };
}

/** `1234` minor units → `12.34` (no floating point). */
export function minorToText(minor: number, currency: string): string {
  const d = minorDigits(currency);
  if (d === 0) return String(minor);
  const s = String(Math.abs(minor)).padStart(d + 1, "0");
  return `${minor < 0 ? "-" : ""}${s.slice(0, -d)}.${s.slice(-d)}`;
}

/** `12.3` → 1230 minor units; an error text for anything but a non-negative amount. */
export function parseMoney(text: string, currency: string): number | string {
  const d = minorDigits(currency);
  const t = text.trim().replace(/,/g, "");
  const re = d === 0 ? /^\d+$/ : new RegExp(`^\\d+(\\.\\d{1,${d}})?$`);
  if (!re.test(t)) {
    return d === 0
      ? `a whole amount of ${currency}`
      : `an amount of ${currency} with at most ${d} decimals, like 250.00`;
  }
  const [whole, frac = ""] = t.split(".");
  const minor = Number(whole) * 10 ** d + Number(frac.padEnd(d, "0") || "0");
  if (!Number.isSafeInteger(minor)) return "too large";
  return minor;
}

/** A whole number ≥ `min`, or null for an empty input; else an error text. */
export function parseLimit(text: string, min: number): number | null | string {
  const t = text.trim().replace(/[,_ ]/g, "");
  if (t === "") return null;
  if (!/^\d+$/.test(t)) return `a whole number of at least ${min}, or empty for no limit`;
  const n = Number(t);
  if (!Number.isSafeInteger(n)) return "too large";
  if (n < min) return `a whole number of at least ${min}, or empty for no limit`;
  return n;
}

/**
 * The merge patch that turns `current` into what the form says (only changed fields), or
 * the errors per field. Platform fields are left out unless `platform`.
 */
export function policyPatch(
  current: Policy,
  form: PolicyForm,
  currency: string,
  platform: boolean,
): { patch: Partial<Policy>; errors: Errors } {
  const errors: Errors = {};
  const next: Partial<Policy> = {};
  const text = (k: string) => String(form[k] ?? "");
  for (const [k] of LIMIT_FIELDS) {
    const v = parseLimit(text(k), 1);
    if (typeof v === "string") errors[k] = v;
    else (next as Record<string, unknown>)[k] = v;
  }
  const budget = text("monthly_budget").trim();
  if (budget === "") next.monthly_budget_minor = null;
  else {
    const v = parseMoney(budget, currency);
    if (typeof v === "string") errors.monthly_budget = v;
    else next.monthly_budget_minor = v;
  }
  const alert = parseLimit(text("budget_alert_percent"), 1);
  if (typeof alert !== "number" || alert > 100) {
    errors.budget_alert_percent = "a whole number from 1 to 100";
  } else next.budget_alert_percent = alert;
  next.allow_1h_ttl = Boolean(form.allow_1h_ttl);
  const mc = parseLimit(text("max_concurrent"), 1);
  if (typeof mc === "string") errors.max_concurrent = mc;
  else next.max_concurrent = mc;
  const ttl = parseLimit(text("max_cache_ttl_secs"), 300);
  if (typeof ttl !== "number" || ttl > 2592000) {
    errors.max_cache_ttl_secs = "a whole number of seconds from 300 (5 minutes) to 2592000 (30 days)";
  } else next.max_cache_ttl_secs = ttl;
  if (platform) {
    const w = parseLimit(text("engine_weight"), 1);
    if (typeof w !== "number" || w > 100) errors.engine_weight = "a whole number from 1 to 100";
    else next.engine_weight = w;
    for (const k of ["cache_resident_bytes", "reserved_cache_bytes"] as const) {
      const v = parseLimit(text(k), 0);
      if (typeof v === "string") errors[k] = v.replace("at least 0", "bytes (0 or more)");
      else next[k] = v;
    }
    const r = parseLimit(text("replication_factor"), 1);
    if (typeof r === "string" || (typeof r === "number" && r > 16)) {
      errors.replication_factor = "from 1 to 16, or empty for the cluster's default";
    } else next.replication_factor = r;
    if (
      typeof next.reserved_cache_bytes === "number" &&
      typeof next.cache_resident_bytes === "number" &&
      next.reserved_cache_bytes > next.cache_resident_bytes
    ) {
      errors.reserved_cache_bytes = "cannot be more than the resident bytes limit";
    }
  }
  const patch: Partial<Policy> = {};
  for (const [k, v] of Object.entries(next) as [keyof Policy, unknown][]) {
    if (current[k] !== v) (patch as Record<string, unknown>)[k] = v;
  }
  if (platform) {
    const c = ceilingsPatch(current.ceilings, form, currency);
    Object.assign(errors, c.errors);
    if (Object.keys(c.patch).length) patch.ceilings = c.patch as Ceilings;
  } else {
    // Only what changed is checked: a value the platform lowered is already within.
    for (const [k, e] of Object.entries(ceilingErrors(patch, current.ceilings, currency))) errors[k] ??= e;
  }
  return { patch, errors };
}

/** The rate limits a key may have of its own: [field, label]. */
export const KEY_LIMIT_FIELDS = [
  ["requests_per_minute", "Requests per minute"],
  ["input_tokens_per_minute", "Uncached input tokens per minute"],
  ["output_tokens_per_minute", "Output tokens per minute"],
] as const;

/**
 * A key's own limits from the form (empty: the tenant's per-key default), checked against
 * its workspace's and the tenant's limits (a key's may not be above either): the changed
 * fields as a merge patch, or errors per field.
 */
export function keyLimitsPatch(
  current: Limits,
  form: Record<string, string>,
  workspace: Limits,
  tenant: Limits,
): { patch: Partial<Limits>; errors: Errors } {
  const errors: Errors = {};
  const patch: Partial<Limits> = {};
  for (const [k] of KEY_LIMIT_FIELDS) {
    const v = parseLimit(form[k] ?? "", 1);
    if (typeof v === "string") {
      errors[k] = v.replace("no limit", "the tenant's per-key default");
      continue;
    }
    const above = ([[workspace[k], "its workspace's"], [tenant[k], "the tenant's"]] as const).find(([cap]) => v !== null && cap !== null && v > cap);
    if (above) errors[k] = `at most ${above[0]!.toLocaleString("en-US")} (${above[1]} limit)`;
    else if (v !== current[k]) patch[k] = v;
  }
  return { patch, errors };
}

/** A new key's name and expiry (a `datetime-local` value, read as UTC). */
export function validateKey(name: string, expires: string, now = new Date()): {
  value?: { name: string; expires_at: string | null };
  errors: Errors;
} {
  const errors: Errors = {};
  const n = name.trim();
  if (n.length < 1 || n.length > 200) errors.name = "1 to 200 characters";
  let expires_at: string | null = null;
  if (expires.trim() !== "") {
    const t = new Date(`${expires.trim()}${expires.includes("Z") ? "" : "Z"}`);
    if (Number.isNaN(t.getTime())) errors.expires = "a date and time";
    else if (t <= now) errors.expires = "must be in the future";
    else expires_at = t.toISOString();
  }
  return Object.keys(errors).length ? { errors } : { value: { name: n, expires_at }, errors };
}

/** A rotation's grace period in hours → seconds (0 to 30 days). */
export function parseGrace(hours: string): number | string {
  const t = hours.trim();
  if (!/^\d+(\.\d+)?$/.test(t)) return "hours, like 24 or 0.5";
  const secs = Math.round(Number(t) * 3600);
  if (secs > 30 * 86400) return "at most 30 days (720 hours)";
  return secs;
}

/** A new console user. */
export function validateUser(u: {
  username: string;
  password: string;
  role: string;
  tenant: string;
}): Errors {
  const errors: Errors = {};
  if (!/^[A-Za-z0-9._@+-]{1,128}$/.test(u.username.trim())) {
    errors.username = "1 to 128 letters, digits or . _ @ + -";
  }
  if ([...u.password].length < 12) errors.password = "at least 12 characters";
  else if (u.password.toLowerCase() === u.username.trim().toLowerCase()) {
    errors.password = "must not be the username";
  }
  if (!["platform_admin", "tenant_admin", "finance"].includes(u.role)) errors.role = "choose a role";
  if (u.role === "tenant_admin" && !u.tenant) errors.tenant = "a tenant admin needs a tenant";
  return errors;
}

/** A new password: 12+ characters, not the username, typed twice the same. */
export function validateNewPassword(p: { username: string; password: string; confirm: string }): Errors {
  const errors: Errors = {};
  if ([...p.password].length < 12) errors.password = "at least 12 characters";
  else if (p.password.length > 1024) errors.password = "at most 1024 bytes";
  else if (p.username && p.password.toLowerCase() === p.username.trim().toLowerCase()) {
    errors.password = "must not be the username";
  }
  if (p.confirm !== p.password) errors.confirm = "the two passwords differ";
  return errors;
}

/** A list-price version to add, as the finance API takes it. */
export interface NewPrice extends PriceRates {
  model: string;
  effective_from: string;
  currency: string;
  backdate: boolean;
}

/** "3" or "0.125" (currency units per million tokens) → nano-units per token (3000, 125). */
export function perMillionToNanos(text: string): number | string {
  const t = text.trim();
  if (!/^\d+(\.\d{1,3})?$/.test(t)) return "a price per million tokens, up to 3 decimals (e.g. 3 or 0.125)";
  const [whole, frac = ""] = t.split(".");
  const nanos = Number(whole) * 1000 + Number(frac.padEnd(3, "0"));
  return Number.isSafeInteger(nanos) ? nanos : "too large";
}

/** "1.25" (× the input price) → basis points (12500). */
export function multiplierToBp(text: string): number | string {
  const t = text.trim();
  if (!/^\d+(\.\d{1,4})?$/.test(t)) return "a multiple of the input price, up to 4 decimals (e.g. 1.25)";
  const [whole, frac = ""] = t.split(".");
  const bp = Number(whole) * 10000 + Number(frac.padEnd(4, "0"));
  return bp <= 1_000_000 ? bp : "at most 100×";
}

/** The price form (text inputs) → a version to add, or the errors by field. `now` decides
 * whether the date is in the past, which is a correction the user must confirm. */
export function parsePrice(
  f: { model: string; from: string; currency: string; input: string; output: string; w5: string; w1: string; read: string; storage: string; backdate: boolean },
  now: Date,
): { value?: NewPrice; errors: Errors } {
  const errors: Errors = {};
  const model = f.model.trim();
  if (!/^[A-Za-z0-9._:/-]{1,128}$/.test(model)) errors.model = "the model's id, as requests name it";
  const from = new Date(f.from.endsWith("Z") ? f.from : `${f.from}Z`);
  if (!f.from || Number.isNaN(from.getTime())) errors.from = "when it takes effect (UTC)";
  else if (from < now && !f.backdate) errors.from = "in the past: tick the correction box to re-price usage already rated";
  const currency = f.currency.trim().toUpperCase();
  if (!/^[A-Z]{3}$/.test(currency)) errors.currency = "a three-letter currency code (USD)";
  const num = (key: string, v: number | string) => {
    if (typeof v === "string") errors[key] = v;
    return typeof v === "number" ? v : 0;
  };
  const value: NewPrice = {
    model,
    effective_from: Number.isNaN(from.getTime()) ? "" : from.toISOString(),
    currency,
    input_nanos: num("input", perMillionToNanos(f.input)),
    output_nanos: num("output", perMillionToNanos(f.output)),
    cache_write_5m_bp: num("w5", multiplierToBp(f.w5)),
    cache_write_1h_bp: num("w1", multiplierToBp(f.w1)),
    cache_read_bp: num("read", multiplierToBp(f.read)),
    cache_storage_hour_bp: num("storage", multiplierToBp(f.storage)),
    backdate: f.backdate && from < now,
  };
  return Object.keys(errors).length ? { errors } : { value, errors };
}

/** A tenant name. */
export function validateTenantName(name: string): string | null {
  const n = name.trim();
  if (n.length < 1 || n.length > 200) return "1 to 200 characters";
  // eslint-disable-next-line no-control-regex
  if (/[\u0000-\u001f\u007f]/.test(n)) return "no control characters";
  return null;
}

/** A date range (two `YYYY-MM-DD` inputs, the end inclusive) as RFC 3339 `[from, to)`. */
export function dateRange(from: string, to: string): { from: string; to: string } | string {
  const f = new Date(`${from}T00:00:00Z`);
  const t = new Date(`${to}T00:00:00Z`);
  if (Number.isNaN(f.getTime()) || Number.isNaN(t.getTime())) return "choose both dates";
  if (t < f) return "the end is before the start";
  const end = new Date(t.getTime() + 86400_000);
  if (end.getTime() - f.getTime() > 400 * 86400_000) return "at most 400 days";
  return { from: f.toISOString(), to: end.toISOString() };
}

/** An export's file name: the ledger, each filter that narrows it (names, not ids), the
 * range and the format, so two downloads with different filters never share a name. */
export function exportFileName(f: {
  ledger: string;
  tenant: string;
  workspace: string;
  key: string;
  model: string;
  from: string;
  to: string;
  format: "csv" | "jsonl" | "cloudevents";
}): string {
  const part = (s: string) => s.trim().replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "");
  const parts = ["cachet", f.ledger, f.tenant || "all-tenants", f.workspace, f.key, f.model, f.from, f.to]
    .map(part)
    .filter((p) => p.length > 0);
  const kind = f.format === "cloudevents" ? "-cloudevents" : "";
  return `${parts.join("-")}${kind}.${f.format === "csv" ? "csv" : "jsonl"}`;
}

/** How long an extended cache object may be held, from now: the usual lifetimes up to the
 * tenant's longest (`max_cache_ttl_secs`, its policy), and that longest itself when it is not
 * one of them; every usual one while the policy is not known yet. */
export function extendChoices(maxSecs: number | undefined): [string, string][] {
  const usual: [string, string, number][] = [
    ["1h", "1 hour", 3600],
    ["24h", "24 hours", 86_400],
    ["7d", "7 days", 604_800],
    ["30d", "30 days", 2_592_000],
  ];
  if (maxSecs === undefined) return usual.map(([v, l]) => [v, l]);
  const fit: [string, string][] = usual.filter(([, , s]) => s <= maxSecs).map(([v, l]) => [v, l]);
  if (!usual.some(([, , s]) => s === maxSecs)) fit.push([`${maxSecs}s`, `${formatDuration(maxSecs * 1000)} (the longest allowed)`]);
  return fit;
}

/** Tags as a form shows them: `team=search, env=prod` (by name). */
export function tagsText(tags: Record<string, string> | undefined): string {
  return Object.entries(tags ?? {})
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([k, v]) => `${k}=${v}`)
    .join(", ");
}

/**
 * `team=search, env=prod` as tags, checked as the server checks them (at most 20; a name of 1
 * to 64 letters, digits and `_ . : / -`, not starting with "cachet"; a value of at most 256
 * characters), or an error text naming the tag.
 */
export function parseTags(text: string): Record<string, string> | string {
  const tags: Record<string, string> = {};
  for (const part of text.split(",").map((p) => p.trim()).filter((p) => p.length > 0)) {
    const eq = part.indexOf("=");
    if (eq < 0) return `"${part}": write each tag as tag=value`;
    const name = part.slice(0, eq).trim();
    const value = part.slice(eq + 1).trim();
    if (!/^[A-Za-z0-9_.:/-]{1,64}$/.test(name)) return `"${name}" is not a tag name (1 to 64 of letters, digits and _ . : / -)`;
    if (name.toLowerCase().startsWith("cachet")) return `"${name}": names starting with "cachet" are Cachet's own`;
    if ([...value].length > 256) return `${name}: a value of at most 256 characters`;
    if (name in tags) return `${name} is given twice`;
    tags[name] = value;
  }
  if (Object.keys(tags).length > 20) return "at most 20 tags";
  return tags;
}
