// How the console shows numbers. Money arrives as integer minor units (cents) and is never
// computed in floating point here: it is only formatted.

/** Digits of a currency's minor unit (ISO 4217), as the server counts them. */
export function minorDigits(currency: string): number {
  if (["JPY", "KRW", "VND", "CLP", "ISK"].includes(currency)) return 0;
  if (["BHD", "KWD", "OMR", "JOD", "TND"].includes(currency)) return 3;
  return 2;
}

/** The symbol written before amounts of `currency`, if it has a common one. */
function symbolOf(currency: string): string {
  return ({ USD: "$", EUR: "€", GBP: "£" } as Record<string, string>)[currency] ?? "";
}

/** `123456` USD → `$1,234.56`; negative amounts keep their sign. */
export function formatMoney(minor: number, currency = "USD"): string {
  const digits = minorDigits(currency);
  const negative = minor < 0;
  const abs = Math.abs(minor);
  const unit = 10 ** digits;
  const whole = Math.floor(abs / unit);
  const frac = abs % unit;
  const grouped = whole.toLocaleString("en-US");
  const symbol = symbolOf(currency);
  const number = digits > 0 ? `${grouped}.${String(frac).padStart(digits, "0")}` : grouped;
  const text = symbol ? `${symbol}${number}` : `${number} ${currency}`;
  return negative ? `−${text}` : text;
}

/**
 * An amount that may be below the minor unit: `minor` (rounded, as billed) when it is not zero,
 * else the server's `exact` decimal text (`"0.0000519"`) cut to two significant digits by its
 * digits alone (`$0.000051`), so a sub-cent cost reads as what it is, not `$0.00`; `$0.00` when
 * the exact amount is zero too.
 */
export function formatCost(minor: number, exact: string | undefined, currency = "USD"): string {
  if (minor !== 0 || !exact) return formatMoney(minor, currency);
  const m = /^(-?)0\.(0*)([1-9]\d?)/.exec(exact.trim());
  if (!m) return formatMoney(minor, currency);
  const [, sign, zeros, digits] = m;
  const number = `0.${zeros}${digits}`;
  const symbol = symbolOf(currency);
  const text = symbol ? `${symbol}${number}` : `${number} ${currency}`;
  return sign === "-" ? `−${text}` : text;
}

/** An axis value in minor units (fractions of a cent included): `0.25` USD → `$0.0025`. */
export function formatMoneyAxis(minor: number, currency = "USD"): string {
  const major = minor / 10 ** minorDigits(currency);
  const text = major.toLocaleString("en-US", { maximumFractionDigits: Math.abs(major) < 1 ? 4 : 2 });
  const symbol = symbolOf(currency);
  return symbol ? `${symbol}${text}` : `${text} ${currency}`;
}

/** Token counts: exact below 1,000, then K / M / B with three significant digits. */
export function formatTokens(n: number): string {
  const abs = Math.abs(n);
  const sign = n < 0 ? "−" : "";
  if (abs < 1000) return `${sign}${abs}`;
  for (const [size, suffix] of [
    [1e9, "B"],
    [1e6, "M"],
    [1e3, "K"],
  ] as const) {
    if (abs >= size) {
      const v = abs / size;
      const digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
      return `${sign}${trimZeros(v.toFixed(digits))}${suffix}`;
    }
  }
  return `${sign}${abs}`;
}

function trimZeros(s: string): string {
  return s.includes(".") ? s.replace(/\.?0+$/, "") : s;
}

/** A ratio 0..1 as a percentage with at most one decimal: 0.375 → `37.5%`. */
export function formatRatio(r: number): string {
  if (!Number.isFinite(r)) return "–";
  const pct = Math.round(r * 1000) / 10;
  return `${trimZeros(pct.toFixed(1))}%`;
}

/** Bytes in binary units: 1536 → `1.5 KiB`. */
export function formatBytes(n: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n;
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${v} B` : `${trimZeros(v.toFixed(v >= 100 ? 0 : 1))} ${units[i]}`;
}

/** A duration in milliseconds: `4m 12s`, `1h 5m`, `12s`. */
export function formatDuration(ms: number): string {
  let s = Math.max(0, Math.round(ms / 1000));
  const h = Math.floor(s / 3600);
  s -= h * 3600;
  const m = Math.floor(s / 60);
  s -= m * 60;
  if (h > 0) return m > 0 ? `${h}h ${m}m` : `${h}h`;
  if (m > 0) return s > 0 ? `${m}m ${s}s` : `${m}m`;
  return `${s}s`;
}

/** An RFC 3339 time as `2026-11-24 10:05 UTC` (the service's clock is UTC). */
/** `n` of a `noun` in words: "1 tenant", "2 tenants" (a plain -s plural). */
export function count(n: number, noun: string): string {
  return `${n.toLocaleString("en-US")} ${noun}${n === 1 ? "" : "s"}`;
}

export function formatTime(iso: string | null | undefined): string {
  if (!iso) return "–";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return iso;
  return `${d.toISOString().slice(0, 16).replace("T", " ")} UTC`;
}

/** The limit of a policy field: a number, or "no limit". */
export function formatLimit(v: number | null | undefined, unit = ""): string {
  if (v === null || v === undefined) return "no limit";
  return `${v.toLocaleString("en-US")}${unit ? ` ${unit}` : ""}`;
}

/** What releasing a deleted object's blocks did, in words. */
export function releasedText(d: { bytes_freed: number; bytes_held: number; nodes_pending: string[] }): string {
  const held = d.bytes_held > 0 ? `; ${formatBytes(d.bytes_held)} still held by other cached prefixes` : "";
  const pending =
    d.nodes_pending.length > 0 ? ` ${d.nodes_pending.join(", ")} will release it when it catches up.` : "";
  return `${formatBytes(d.bytes_freed)} freed${held}.${pending}`;
}

/** Why a cache write was not held, in words (the reasons of the response's `cachet` field). */
const NOT_HELD: Record<string, string> = {
  quota: "over the tenant's cache quota (resident bytes)",
  capacity: "the cache nodes were full",
  not_admitted: "automatic caching ranked them below what they would displace",
  unavailable: "no cache node for them could be reached",
  kv_budget: "larger than the server's KV memory budget",
};

/**
 * The dashboard's sentence on cache writes not held ("2 cache writes were not held: 2 over the
 * tenant's cache quota (1,200 tokens) …"), or null when every write was held.
 */
export function writesNotHeld(rows: { reason: string; breakpoints: number; tokens: number }[]): string | null {
  const total = rows.reduce((n, r) => n + r.breakpoints, 0);
  if (total === 0) return null;
  const parts = rows.map(
    (r) => `${r.breakpoints.toLocaleString("en-US")} ${NOT_HELD[r.reason] ?? `a cache error (${r.reason})`} (${count(r.tokens, "token")})`,
  );
  return (
    `${count(total, "cache write")} ${total === 1 ? "was" : "were"} not held in this range, for the whole tenant: ${parts.join("; ")}. ` +
    "Their tokens were billed at the next written breakpoint's rate or as plain input, not as cache writes."
  );
}

/**
 * Exact amounts (`"0.0000519"`, the API's strings) added without rounding, in the currency:
 * the sum as an exact string and rounded to minor units (half away from zero), so a group of
 * sub-cent buckets shows what it cost instead of a sum of rounded zeros.
 */
export function sumExact(amounts: string[], currency: string): { exact: string; minor: number } {
  const SCALE = 18;
  let total = 0n;
  for (const a of amounts) {
    const m = /^(-?)(\d+)(?:\.(\d{1,18}))?$/.exec(a.trim());
    if (!m) continue;
    const v = BigInt(m[2]) * 10n ** BigInt(SCALE) + BigInt((m[3] ?? "").padEnd(SCALE, "0") || "0");
    total += m[1] ? -v : v;
  }
  const neg = total < 0n;
  const abs = neg ? -total : total;
  const whole = abs / 10n ** BigInt(SCALE);
  const frac = (abs % 10n ** BigInt(SCALE)).toString().padStart(SCALE, "0").replace(/0+$/, "");
  const d = minorDigits(currency);
  const exact = `${neg ? "-" : ""}${whole}${frac || d ? "." : ""}${frac.padEnd(d, "0")}`;
  const unit = 10n ** BigInt(SCALE - d);
  const minorAbs = (abs + unit / 2n) / unit;
  return { exact, minor: Number(neg ? -minorAbs : minorAbs) };
}
