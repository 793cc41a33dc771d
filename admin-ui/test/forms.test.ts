import { describe, expect, it } from "vitest";
import {
  dateRange,
  extendChoices,
  exportFileName,
  minorToText,
  parseGrace,
  parseLimit,
  parseMoney,
  type Policy,
  policyForm,
  policyPatch,
  ceilingText,
  keyLimitsPatch,
  parseTags,
  tagsText,
  validateKey,
  validateTenantName,
  validateNewPassword,
  validateUser,
} from "../src/forms";

const policy: Policy = {
  requests_per_minute: null,
  input_tokens_per_minute: 400000,
  output_tokens_per_minute: null,
  key_requests_per_minute: null,
  key_input_tokens_per_minute: null,
  key_output_tokens_per_minute: null,
  monthly_budget_minor: 25000,
  budget_alert_percent: 80,
  cache_resident_bytes: 1073741824,
  reserved_cache_bytes: null,
  allow_1h_ttl: true,
  replication_factor: null,
  engine_weight: 1,
  max_concurrent: null,
  max_cache_ttl_secs: 86400,
  ceilings: {
    requests_per_minute: null,
    input_tokens_per_minute: null,
    output_tokens_per_minute: null,
    monthly_budget_minor: null,
    allow_1h_ttl: true,
    max_cache_ttl_secs: null,
    max_concurrent: null,
  },
};

const capped: Policy = {
  ...policy,
  requests_per_minute: 600,
  max_concurrent: 4,
  ceilings: { ...policy.ceilings, requests_per_minute: 600, monthly_budget_minor: 50000, allow_1h_ttl: false, max_concurrent: 4 },
  allow_1h_ttl: false,
};

describe("the policy form", () => {
  it("round-trips a policy with no change", () => {
    const form = policyForm(policy, "USD");
    expect(form.monthly_budget).toBe("250.00");
    expect(policyPatch(policy, form, "USD", true)).toEqual({ patch: {}, errors: {} });
  });

  it("sends only the changed fields; empty means no limit", () => {
    const form = { ...policyForm(policy, "USD"), requests_per_minute: "2", input_tokens_per_minute: "", monthly_budget: "99.5" };
    const { patch, errors } = policyPatch(policy, form, "USD", false);
    expect(errors).toEqual({});
    expect(patch).toEqual({ requests_per_minute: 2, input_tokens_per_minute: null, monthly_budget_minor: 9950 });
  });

  it("names every invalid field before sending", () => {
    const form = {
      ...policyForm(policy, "USD"),
      requests_per_minute: "0",
      output_tokens_per_minute: "12.5",
      monthly_budget: "-3",
      budget_alert_percent: "101",
      replication_factor: "17",
      reserved_cache_bytes: "2147483648",
      engine_weight: "0",
      max_concurrent: "0",
      max_cache_ttl_secs: "60",
    };
    const { errors } = policyPatch(policy, form, "USD", true);
    expect(Object.keys(errors).sort()).toEqual(
      [
        "budget_alert_percent",
        "engine_weight",
        "max_cache_ttl_secs",
        "max_concurrent",
        "monthly_budget",
        "output_tokens_per_minute",
        "replication_factor",
        "requests_per_minute",
        "reserved_cache_bytes",
      ].sort(),
    );
    expect(errors.requests_per_minute).toContain("at least 1");
    expect(errors.reserved_cache_bytes).toContain("resident");
  });

  it("leaves the platform's fields out for a tenant admin", () => {
    const form = { ...policyForm(policy, "USD"), cache_resident_bytes: "5", replication_factor: "3", engine_weight: "4" };
    expect(policyPatch(policy, form, "USD", false).patch).toEqual({});
    expect(policyPatch(policy, form, "USD", true).patch).toEqual({ cache_resident_bytes: 5, replication_factor: 3, engine_weight: 4 });
  });

  it("refuses a tenant admin's value above a ceiling, or none under one, before sending", () => {
    const form = {
      ...policyForm(capped, "USD"),
      requests_per_minute: "601",
      monthly_budget: "600",
      max_concurrent: "",
      allow_1h_ttl: true,
    };
    const { errors } = policyPatch(capped, form, "USD", false);
    expect(errors.requests_per_minute).toBe("at most 600 (the platform's ceiling)");
    expect(errors.max_concurrent).toBe("the platform's ceiling is 4: enter a value up to it");
    expect(errors.monthly_budget).toBe("at most 500.00 USD (the platform's ceiling)");
    expect(errors.allow_1h_ttl).toContain("1-hour");
    const lower = { ...policyForm(capped, "USD"), requests_per_minute: "100", max_concurrent: "2" };
    expect(policyPatch(capped, lower, "USD", false)).toEqual({ patch: { requests_per_minute: 100, max_concurrent: 2 }, errors: {} });
    expect(ceilingText(capped.ceilings, "monthly_budget_minor", "USD")).toBe("Ceiling set by the platform: at most 500.00 USD.");
    expect(ceilingText(capped.ceilings, "output_tokens_per_minute", "USD")).toBeUndefined();
  });

  it("gives a platform admin the ceilings, sending only those changed", () => {
    const form = { ...policyForm(capped, "USD"), ceiling_requests_per_minute: "300", ceiling_max_concurrent: "", ceiling_allow_1h_ttl: true };
    expect(policyPatch(capped, form, "USD", true)).toEqual({
      patch: { ceilings: { requests_per_minute: 300, max_concurrent: null, allow_1h_ttl: true } },
      errors: {},
    });
    const bad = { ...policyForm(capped, "USD"), ceiling_requests_per_minute: "0", ceiling_max_cache_ttl_secs: "60" };
    expect(Object.keys(policyPatch(capped, bad, "USD", true).errors).sort()).toEqual(["ceiling_max_cache_ttl_secs", "ceiling_requests_per_minute"]);
    // A tenant admin's form never sends ceilings.
    expect(policyPatch(capped, form, "USD", false).patch).toEqual({});
  });

  it("lets a tenant admin cap its own concurrency", () => {
    const form = { ...policyForm(policy, "USD"), max_concurrent: "3" };
    expect(policyPatch(policy, form, "USD", false).patch).toEqual({ max_concurrent: 3 });
    expect(policyPatch({ ...policy, max_concurrent: 3 }, { ...form, max_concurrent: "" }, "USD", false).patch).toEqual({
      max_concurrent: null,
    });
  });
});

describe("the longest cache object TTL", () => {
  it("is a tenant admin's to set, from 5 minutes to 30 days", () => {
    const form = { ...policyForm(policy, "USD"), max_cache_ttl_secs: "604800" };
    expect(policyPatch(policy, form, "USD", false).patch).toEqual({ max_cache_ttl_secs: 604800 });
    for (const bad of ["", "299", "2592001", "1h"]) {
      const { errors } = policyPatch(policy, { ...form, max_cache_ttl_secs: bad }, "USD", false);
      expect(errors.max_cache_ttl_secs).toContain("2592000");
    }
  });
});

describe("money and limits", () => {
  it("parses amounts into minor units without floating point", () => {
    expect(parseMoney("0.1", "USD")).toBe(10);
    expect(parseMoney("1,234.56", "USD")).toBe(123456);
    expect(parseMoney("19.99", "USD")).toBe(1999);
    expect(parseMoney("500", "JPY")).toBe(500);
    expect(typeof parseMoney("1.234", "USD")).toBe("string");
    expect(typeof parseMoney("5.5", "JPY")).toBe("string");
    expect(typeof parseMoney("abc", "USD")).toBe("string");
    expect(minorToText(5, "USD")).toBe("0.05");
    expect(minorToText(123456, "USD")).toBe("1234.56");
  });
  it("parses limits", () => {
    expect(parseLimit("", 1)).toBeNull();
    expect(parseLimit("1_000", 1)).toBe(1000);
    expect(typeof parseLimit("0", 1)).toBe("string");
    expect(parseLimit("0", 0)).toBe(0);
    expect(typeof parseLimit("1e3", 1)).toBe("string");
  });
});

describe("other forms", () => {
  const now = new Date("2026-11-24T10:00:00Z");
  it("keys need a name and a future expiry", () => {
    expect(validateKey("ci", "", now)).toEqual({ value: { name: "ci", expires_at: null }, errors: {} });
    expect(validateKey("ci", "2026-12-01T00:00", now).value?.expires_at).toBe("2026-12-01T00:00:00.000Z");
    expect(validateKey("  ", "", now).errors.name).toBeTruthy();
    expect(validateKey("ci", "2026-11-01T00:00", now).errors.expires).toBe("must be in the future");
  });
  it("grace periods are hours up to 30 days", () => {
    expect(parseGrace("24")).toBe(86400);
    expect(parseGrace("0.5")).toBe(1800);
    expect(parseGrace("0")).toBe(0);
    expect(typeof parseGrace("721")).toBe("string");
    expect(typeof parseGrace("-1")).toBe("string");
  });
  it("users and tenants", () => {
    expect(validateUser({ username: "ana", password: "a long passphrase", role: "finance", tenant: "" })).toEqual({});
    const bad = validateUser({ username: "a b", password: "short", role: "tenant_admin", tenant: "" });
    expect(Object.keys(bad).sort()).toEqual(["password", "tenant", "username"]);
    expect(validateTenantName("acme")).toBeNull();
    expect(validateTenantName("")).toBeTruthy();
  });
  it("new passwords: long enough, not the username, typed twice alike", () => {
    expect(validateNewPassword({ username: "ana", password: "a long passphrase", confirm: "a long passphrase" })).toEqual({});
    expect(validateNewPassword({ username: "ana", password: "short", confirm: "short" })).toEqual({ password: "at least 12 characters" });
    expect(validateNewPassword({ username: "ana-the-admin", password: "ANA-THE-ADMIN", confirm: "ANA-THE-ADMIN" })).toEqual({
      password: "must not be the username",
    });
    expect(validateNewPassword({ username: "", password: "a long passphrase", confirm: "a long passphrase!" })).toEqual({
      confirm: "the two passwords differ",
    });
  });
  it("date ranges include their last day", () => {
    expect(dateRange("2026-11-01", "2026-11-30")).toEqual({ from: "2026-11-01T00:00:00.000Z", to: "2026-12-01T00:00:00.000Z" });
    expect(dateRange("2026-11-02", "2026-11-01")).toBe("the end is before the start");
  });
});

describe("export file names", () => {
  const base = { ledger: "usage", tenant: "", workspace: "", key: "", model: "", from: "2026-11-01", to: "2026-11-30" };
  it("say every filter, by name, and the format", () => {
    expect(exportFileName({ ...base, format: "csv" })).toBe("cachet-usage-all-tenants-2026-11-01-2026-11-30.csv");
    expect(exportFileName({ ...base, tenant: "ACME Corp", workspace: "research", key: "ci bot", model: "sim-tiny", format: "jsonl" })).toBe(
      "cachet-usage-ACME_Corp-research-ci_bot-sim-tiny-2026-11-01-2026-11-30.jsonl",
    );
    expect(exportFileName({ ...base, ledger: "storage", tenant: "ACME", format: "cloudevents" })).toBe(
      "cachet-storage-ACME-2026-11-01-2026-11-30-cloudevents.jsonl",
    );
  });
  it("never carry a path or odd characters from a name", () => {
    expect(exportFileName({ ...base, tenant: "../../etc/pass wd", format: "csv" })).toBe("cachet-usage-.._.._etc_pass_wd-2026-11-01-2026-11-30.csv");
  });
});

describe("extending a cache object", () => {
  it("offers only the lifetimes the tenant's policy allows, and its longest", () => {
    expect(extendChoices(86_400).map(([v]) => v)).toEqual(["1h", "24h"]);
    expect(extendChoices(2_592_000).map(([v]) => v)).toEqual(["1h", "24h", "7d", "30d"]);
    expect(extendChoices(7_200)).toEqual([
      ["1h", "1 hour"],
      ["7200s", "2h (the longest allowed)"],
    ]);
    expect(extendChoices(1_800)).toEqual([["1800s", "30m (the longest allowed)"]]);
    expect(extendChoices(undefined).length).toBe(4);
  });
});

describe("a key's own limits", () => {
  const none = { requests_per_minute: null, input_tokens_per_minute: null, output_tokens_per_minute: null, monthly_budget_minor: null };
  it("sends only what changed; empty goes back to the tenant's default", () => {
    const current = { ...none, requests_per_minute: 50 };
    const form = { requests_per_minute: "", input_tokens_per_minute: "1,000", output_tokens_per_minute: "" };
    expect(keyLimitsPatch(current, form, none, none)).toEqual({ patch: { requests_per_minute: null, input_tokens_per_minute: 1000 }, errors: {} });
  });
  it("keeps a key within its workspace's and the tenant's limits", () => {
    const form = { requests_per_minute: "700", input_tokens_per_minute: "5000", output_tokens_per_minute: "0" };
    const { errors, patch } = keyLimitsPatch(none, form, { ...none, requests_per_minute: 600 }, { ...none, input_tokens_per_minute: 4000 });
    expect(errors).toEqual({
      requests_per_minute: "at most 600 (its workspace's limit)",
      input_tokens_per_minute: "at most 4,000 (the tenant's limit)",
      output_tokens_per_minute: "a whole number of at least 1, or empty for the tenant's per-key default",
    });
    expect(patch).toEqual({});
  });
});

describe("tags", () => {
  it("read name=value pairs and write them back sorted", () => {
    expect(parseTags(" team=search , env=prod,")).toEqual({ team: "search", env: "prod" });
    expect(parseTags("")).toEqual({});
    expect(parseTags("note=a=b")).toEqual({ note: "a=b" });
    expect(tagsText({ team: "search", env: "prod" })).toBe("env=prod, team=search");
  });
  it("refuse what the server refuses, naming the tag", () => {
    expect(parseTags("team")).toBe('"team": write each tag as tag=value');
    expect(parseTags("bad name=x")).toContain("not a tag name");
    expect(parseTags("cachet:tier=x")).toContain("Cachet's own");
    expect(parseTags("a=1, a=2")).toBe("a is given twice");
    expect(parseTags(Array.from({ length: 21 }, (_, i) => `t${i}=x`).join(","))).toBe("at most 20 tags");
  });
});
