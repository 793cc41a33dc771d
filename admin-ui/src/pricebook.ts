// The price book as the console shows it: list-price versions and which is in force.

/** A list-price version as the finance API lists it. */
export interface PriceVersion {
  model: string;
  effective_from: string;
  currency: string;
  input_nanos: number;
  output_nanos: number;
  cache_write_5m_bp: number;
  cache_write_1h_bp: number;
  cache_read_bp: number;
}

/** nano-units per token → "3.000" per million tokens. */
export const perMillion = (nanos: number) => (nanos / 1000).toFixed(3);
export const times = (bp: number) => `${(bp / 10000).toFixed(2)}×`;

/** Which version of each model is in force at `now`, which are scheduled, which superseded. */
export function priceStates(versions: PriceVersion[], now: Date): Map<PriceVersion, "in force" | "scheduled" | "superseded"> {
  const out = new Map<PriceVersion, "in force" | "scheduled" | "superseded">();
  const byModel = new Map<string, PriceVersion[]>();
  for (const v of versions) byModel.set(v.model, [...(byModel.get(v.model) ?? []), v]);
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

