import { describe, expect, it } from "vitest";
import { multiplierToBp, parsePrice, perMillionToNanos } from "../src/forms";
import { perMillion, priceStates, type PriceVersion, times } from "../src/pricebook";

const v = (model: string, from: string): PriceVersion => ({
  model,
  effective_from: from,
  currency: "USD",
  input_nanos: 3000,
  output_nanos: 15000,
  cache_write_5m_bp: 12500,
  cache_write_1h_bp: 20000,
  cache_read_bp: 1000,
  cache_storage_hour_bp: 10000,
});

describe("the price book", () => {
  it("reads prices per million tokens and multipliers as people write them", () => {
    expect(perMillionToNanos("3")).toBe(3000);
    expect(perMillionToNanos("0.125")).toBe(125);
    expect(perMillionToNanos(" 15 ")).toBe(15000);
    expect(typeof perMillionToNanos("0.0001")).toBe("string");
    expect(typeof perMillionToNanos("-1")).toBe("string");
    expect(typeof perMillionToNanos("3$")).toBe("string");
    expect(multiplierToBp("1.25")).toBe(12500);
    expect(multiplierToBp("0.1")).toBe(1000);
    expect(multiplierToBp("2")).toBe(20000);
    expect(typeof multiplierToBp("101")).toBe("string");
    expect(perMillion(3000)).toBe("3.000");
    expect(times(12500)).toBe("1.25×");
  });
  it("asks before a date in the past, and sends exact integers", () => {
    const now = new Date("2026-11-26T00:00:00Z");
    const form = { model: "sim-llama-8b", from: "2026-12-01T00:00", currency: "usd", input: "0.3", output: "0.6", w5: "1.25", w1: "2", read: "0.1", storage: "0.5", backdate: false };
    expect(parsePrice(form, now)).toEqual({
      value: {
        model: "sim-llama-8b",
        effective_from: "2026-12-01T00:00:00.000Z",
        currency: "USD",
        input_nanos: 300,
        output_nanos: 600,
        cache_write_5m_bp: 12500,
        cache_write_1h_bp: 20000,
        cache_read_bp: 1000,
        cache_storage_hour_bp: 5000,
        backdate: false,
      },
      errors: {},
    });
    const past = { ...form, from: "2026-11-01T00:00" };
    expect(parsePrice(past, now).errors.from).toMatch(/past/);
    expect(parsePrice({ ...past, backdate: true }, now).value?.backdate).toBe(true);
    expect(Object.keys(parsePrice({ ...form, model: "", input: "x" }, now).errors).sort()).toEqual(["input", "model"]);
    expect(parsePrice({ ...form, storage: "-1" }, now).errors.storage).toMatch(/multiple/);
  });
  it("marks the version in force, the scheduled ones and the superseded ones per model", () => {
    const old = v("m", "1970-01-01T00:00:00Z");
    const cur = v("m", "2026-06-01T00:00:00Z");
    const next = v("m", "2027-01-01T00:00:00Z");
    const other = v("n", "2026-01-01T00:00:00Z");
    const s = priceStates([next, old, cur, other], new Date("2026-11-26T00:00:00Z"));
    expect([s.get(old), s.get(cur), s.get(next), s.get(other)]).toEqual(["superseded", "in force", "scheduled", "in force"]);
  });

  it("never puts a retired version in force", () => {
    const old = v("m", "2026-01-01T00:00:00Z");
    const withdrawn = { ...v("m", "2026-06-01T00:00:00Z"), retired_at: "2026-05-01T00:00:00Z" };
    const s = priceStates([old, withdrawn], new Date("2026-11-26T00:00:00Z"));
    expect([s.get(old), s.get(withdrawn)]).toEqual(["in force", "retired"]);
  });
});
