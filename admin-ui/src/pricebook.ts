// The price book as the console shows it: list-price versions and which is in force.

/** A version's rates: nano-units per token, and multipliers of the input price in basis points. */
export interface PriceRates {
  input_nanos: number;
  output_nanos: number;
  cache_write_5m_bp: number;
  cache_write_1h_bp: number;
  cache_read_bp: number;
  /** Holding a cache object, per token and hour, × the input price (basis points). */
  cache_storage_hour_bp: number;
}

/** A list-price version as the finance API lists it. */
export interface PriceVersion extends PriceRates {
  model: string;
  effective_from: string;
  currency: string;
  /** Withdrawn before it took effect: it never priced anything. */
  retired_at?: string | null;
  created_by?: string;
}

export type PriceState = "in force" | "scheduled" | "superseded" | "retired";

/** nano-units per token → "3.000" per million tokens. */
export const perMillion = (nanos: number) => (nanos / 1000).toFixed(3);
export const times = (bp: number) => `${(bp / 10000).toFixed(2)}×`;

/** Which version of each model is in force at `now`, which are scheduled, which superseded,
 * which retired (a retired version is never in force). */
export function priceStates(versions: PriceVersion[], now: Date): Map<PriceVersion, PriceState> {
  const out = new Map<PriceVersion, PriceState>();
  const byModel = new Map<string, PriceVersion[]>();
  for (const v of versions) {
    if (v.retired_at) out.set(v, "retired");
    else byModel.set(v.model, [...(byModel.get(v.model) ?? []), v]);
  }
  for (const vs of byModel.values()) {
    const started = vs.filter((v) => new Date(v.effective_from) <= now);
    const current = started.reduce<PriceVersion | null>(
      (a, v) => (!a || new Date(v.effective_from) > new Date(a.effective_from) ? v : a),
      null,
    );
    for (const v of vs) out.set(v, new Date(v.effective_from) > now ? "scheduled" : v === current ? "in force" : "superseded");
  }
  return out;
}

