import { describe, expect, it } from "vitest";
import { count, formatBytes, formatCost, formatDuration, formatLimit, formatMoney, formatMoneyAxis, formatRatio, formatTime, formatTokens, releasedText, sumExact, writesNotHeld } from "../src/format";

describe("money", () => {
  it("shows a sub-cent cost by its significant digits, not as zero", () => {
    expect(formatCost(0, "0.0000519")).toBe("$0.000051");
    expect(formatCost(0, "0.0049")).toBe("$0.0049");
    expect(formatCost(0, "-0.000003")).toBe("−$0.000003");
    expect(formatCost(0, "0.00")).toBe("$0.00");
    expect(formatCost(0, undefined)).toBe("$0.00");
    expect(formatCost(12, "0.1197")).toBe("$0.12");
    expect(formatCost(0, "0.00007", "EUR")).toBe("€0.00007");
    expect(formatCost(0, "0.4", "JPY")).toBe("0.4 JPY");
  });
  it("formats minor units exactly, with grouping and the currency's digits", () => {
    expect(formatMoney(0)).toBe("$0.00");
    expect(formatMoney(5)).toBe("$0.05");
    expect(formatMoney(123456)).toBe("$1,234.56");
    expect(formatMoney(-105)).toBe("−$1.05");
    expect(formatMoney(1500, "JPY")).toBe("1,500 JPY");
    expect(formatMoney(1234, "KWD")).toBe("1.234 KWD");
    expect(formatMoney(99, "EUR")).toBe("€0.99");
  });

  it("shows fractions of a cent on chart axes", () => {
    expect(formatMoneyAxis(0.25)).toBe("$0.0025");
    expect(formatMoneyAxis(150)).toBe("$1.5");
    expect(formatMoneyAxis(123456)).toBe("$1,234.56");
    expect(formatMoneyAxis(7, "JPY")).toBe("7 JPY");
  });

  it("never rounds through floating point", () => {
    // 2^53 - 1 cents: exact digits, no scientific notation.
    expect(formatMoney(9007199254740991)).toBe("$90,071,992,547,409.91");
  });
});

describe("token counts", () => {
  it("are exact below a thousand and short above", () => {
    expect(formatTokens(0)).toBe("0");
    expect(formatTokens(999)).toBe("999");
    expect(formatTokens(1000)).toBe("1K");
    expect(formatTokens(1234)).toBe("1.23K");
    expect(formatTokens(45_600)).toBe("45.6K");
    expect(formatTokens(1_234_567)).toBe("1.23M");
    expect(formatTokens(250_000_000)).toBe("250M");
    expect(formatTokens(3_100_000_000)).toBe("3.1B");
    expect(formatTokens(-2500)).toBe("−2.5K");
  });
});

describe("ratios", () => {
  it("are percentages with at most one decimal", () => {
    expect(formatRatio(0)).toBe("0%");
    expect(formatRatio(0.375)).toBe("37.5%");
    expect(formatRatio(1 / 3)).toBe("33.3%");
    expect(formatRatio(1)).toBe("100%");
    expect(formatRatio(0.99999)).toBe("100%");
    expect(formatRatio(Number.NaN)).toBe("–");
  });
});

describe("counts in words", () => {
  it("says one without a plural and any other number with one", () => {
    expect(count(1, "tenant")).toBe("1 tenant");
    expect(count(0, "tenant")).toBe("0 tenants");
    expect(count(12345, "request")).toBe("12,345 requests");
  });
});

describe("other units", () => {
  it("bytes are binary", () => {
    expect(formatBytes(512)).toBe("512 B");
    expect(formatBytes(1536)).toBe("1.5 KiB");
    expect(formatBytes(1073741824)).toBe("1 GiB");
    expect(formatBytes(300 * 1048576)).toBe("300 MiB");
  });
  it("durations and times", () => {
    expect(formatDuration(12_400)).toBe("12s");
    expect(formatDuration(252_000)).toBe("4m 12s");
    expect(formatDuration(3_900_000)).toBe("1h 5m");
    expect(formatTime("2026-11-24T10:05:31Z")).toBe("2026-11-24 10:05 UTC");
    expect(formatTime(null)).toBe("–");
    expect(formatLimit(null)).toBe("no limit");
    expect(formatLimit(600, "requests")).toBe("600 requests");
  });
});

describe("a cache object's deletion", () => {
  it("says what was freed, what other prefixes still hold, and which nodes have yet to release it", () => {
    expect(releasedText({ bytes_freed: 2048, bytes_held: 0, nodes_pending: [] })).toBe(`${formatBytes(2048)} freed.`);
    expect(releasedText({ bytes_freed: 0, bytes_held: 4096, nodes_pending: ["n2"] })).toBe(
      `${formatBytes(0)} freed; ${formatBytes(4096)} still held by other cached prefixes. n2 will release it when it catches up.`,
    );
  });
});

describe("cache writes not held", () => {
  it("says nothing when every write was held", () => {
    expect(writesNotHeld([])).toBeNull();
  });
  it("names each reason in words with its tokens", () => {
    const s = writesNotHeld([
      { reason: "quota", breakpoints: 2, tokens: 1200 },
      { reason: "corrupt", breakpoints: 1, tokens: 1 },
    ])!;
    expect(s).toContain("3 cache writes were not held in this range");
    expect(s).toContain("2 over the tenant's cache quota (resident bytes) (1,200 tokens)");
    expect(s).toContain("1 a cache error (corrupt) (1 token)");
    expect(writesNotHeld([{ reason: "capacity", breakpoints: 1, tokens: 5 }])).toMatch(/^1 cache write was not held/);
  });
});

describe("exact sums", () => {
  it("add sub-cent amounts without rounding each", () => {
    const s = sumExact(["0.004", "0.004", "0.0041"], "USD");
    expect(s).toEqual({ exact: "0.0121", minor: 1 });
    expect(sumExact(["0.005"], "USD").minor).toBe(1);
    expect(sumExact(["-0.005", "0.001"], "USD")).toEqual({ exact: "-0.004", minor: 0 });
    expect(sumExact(["12.50", "0.50"], "USD")).toEqual({ exact: "13.00", minor: 1300 });
    expect(sumExact(["1.5", "2"], "JPY")).toEqual({ exact: "3.5", minor: 4 });
    expect(sumExact([], "USD")).toEqual({ exact: "0.00", minor: 0 });
  });
});
