// The admin console end to end: every role logs in through the UI of a real `cachet serve`
// (real Postgres and Redis), and API traffic comes from the official anthropic SDK.
//
// The story: the platform admin creates a tenant and its tenant admin; the tenant admin
// creates a key, and SDK traffic with it shows on the dashboard (tokens, hit ratio); the key is
// rotated (the old secret works during the grace period, then not) and revoked (refused
// within 5 s); requests/min set to 2 refuses the third request of the minute with 429 quoting
// the limit; another tenant's admin sees nothing of the first, in the UI or the API; finance
// downloads a CSV export whose rows are the ledger's. Every page is photographed into
// admin-ui/e2e-artifacts/.

import Anthropic from "@anthropic-ai/sdk";
import type { Browser, Page } from "playwright-core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ARTIFACTS, eventually, launch, type Service, shot, startService } from "./harness";

const ROOT_PASSWORD = "root-password-for-the-e2e-suite";
const ADMIN_PASSWORD = "acme-admin-password-e2e";
const OTHER_PASSWORD = "globex-admin-password-e2e";
const FIN_PASSWORD = "finance-password-e2e-suite";
const SUFFIX = Math.random().toString(36).slice(2, 7);
const ACME = `acme-${SUFFIX}`;
const GLOBEX = `globex-${SUFFIX}`;

let svc: Service;
let browser: Browser;

/** A system prompt long enough to be cached (sim-tiny's minimum is one block). */
const SYSTEM = Array.from({ length: 200 }, (_, i) => `rule ${i}: answer briefly`).join(". ");

function sdk(key: string): Anthropic {
  return new Anthropic({ apiKey: key, baseURL: svc.url, maxRetries: 0 });
}

function ask(key: string, question = "What is a prefix cache?") {
  return sdk(key).messages.create({
    model: "sim-tiny",
    max_tokens: 8,
    system: [{ type: "text", text: SYSTEM, cache_control: { type: "ephemeral" } }],
    messages: [{ role: "user", content: question }],
  });
}

/** The HTTP status an SDK call ended with. */
async function status(p: Promise<unknown>): Promise<number> {
  try {
    await p;
    return 200;
  } catch (e) {
    if (e instanceof Anthropic.APIError && e.status) return e.status;
    throw e;
  }
}

async function page(): Promise<Page> {
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 900 }, acceptDownloads: true });
  const p = await ctx.newPage();
  p.on("pageerror", (e) => {
    throw new Error(`page error: ${e.message}`);
  });
  return p;
}

/** Log in with the keyboard only (labelled fields, Tab and Enter). */
async function logIn(p: Page, username: string, password: string) {
  await p.goto(`${svc.url}/admin/`);
  await p.getByLabel("Username").focus();
  await p.keyboard.type(username);
  await p.keyboard.press("Tab");
  await p.keyboard.type(password);
  await p.keyboard.press("Enter");
  await p.getByRole("button", { name: "Log out" }).waitFor();
}

async function logOut(p: Page) {
  await p.getByRole("button", { name: "Log out" }).click();
  await p.getByLabel("Username").waitFor();
}

async function token(username: string, password: string): Promise<string> {
  const r = await fetch(`${svc.url}/v1/admin/login`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ username, password }),
  });
  expect(r.status).toBe(200);
  return (await r.json()).access_token;
}

async function adminApi(tok: string, method: string, path: string, body?: unknown) {
  const r = await fetch(`${svc.url}${path}`, {
    method,
    headers: { authorization: `Bearer ${tok}`, ...(body ? { "content-type": "application/json" } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  const text = await r.text();
  return { status: r.status, body: text ? JSON.parse(text) : null };
}

beforeAll(async () => {
  svc = await startService();
  svc.cli(["admin", "user", "create", "--username", "root", "--role", "platform_admin", "--password-file", "-"], ROOT_PASSWORD);
  svc.cli(["admin", "user", "create", "--username", "fin", "--role", "finance", "--password-file", "-"], FIN_PASSWORD);
  svc.cli([
    "billing", "price", "--model", "sim-tiny", "--from", "2026-01-01", "--backdate",
    "--input-nanos", "3000", "--output-nanos", "15000",
  ]);
  browser = await launch();
});

afterAll(async () => {
  await browser?.close();
  if (svc) {
    await svc.stop();
  }
});

describe("the admin console", () => {
  let acmeId = "";
  let globexId = "";
  let oldSecret = "";
  let newSecret = "";

  it("lets the platform admin create a tenant and its tenant admin", async () => {
    const p = await page();
    await p.goto(`${svc.url}/admin/`);
    await shot(p, "01-login");
    // A wrong password is refused with the API's text.
    await p.getByLabel("Username").fill("root");
    await p.getByLabel("Password").fill("not the password at all");
    await p.getByRole("button", { name: "Log in" }).click();
    await p.getByText("invalid username or password").waitFor();
    await new Promise((r) => setTimeout(r, 1100)); // the backoff after one failure
    await logIn(p, "root", ROOT_PASSWORD);
    await p.getByRole("heading", { name: "Tenants" }).waitFor();
    await p.getByLabel("New tenant's name").fill(ACME);
    await p.getByRole("button", { name: "Create tenant" }).click();
    await p.getByRole("heading", { name: ACME }).waitFor();
    acmeId = p.url().split("/tenants/")[1].split("/")[0];
    await p.getByRole("link", { name: "Admins" }).first().click();
    await p.getByLabel("Username").fill("acme-admin");
    await p.getByLabel("Password (12+ characters)").fill(ADMIN_PASSWORD);
    await p.getByRole("button", { name: "Create user" }).click();
    await p.getByText("Tenant admin acme-admin created.").waitFor();
    await shot(p, "02-tenant-admins");
    // A second tenant with its own admin, through the API.
    const tok = await token("root", ROOT_PASSWORD);
    const g = await adminApi(tok, "POST", "/v1/admin/tenants", { name: GLOBEX });
    expect(g.status).toBe(201);
    globexId = g.body.id;
    const u = await adminApi(tok, "POST", "/v1/admin/users", {
      username: "globex-admin",
      password: OTHER_PASSWORD,
      role: "tenant_admin",
      tenant: globexId,
    });
    expect(u.status).toBe(201);
    await p.getByRole("link", { name: "Tenants" }).first().click();
    await p.getByRole("link", { name: GLOBEX }).waitFor();
    await shot(p, "03-tenants");
    await p.getByRole("link", { name: "Users" }).first().click();
    await p.getByRole("cell", { name: "globex-admin", exact: true }).waitFor();
    await shot(p, "04-users");
    await p.getByRole("link", { name: "Audit log" }).first().click();
    await p.getByRole("cell", { name: "user.create" }).first().waitFor();
    // Objects by name (the user created, the tenant), and the log fits a 1,280 px window.
    await p.getByRole("cell", { name: "globex-admin", exact: true }).first().waitFor();
    await p.getByRole("cell", { name: GLOBEX, exact: true }).first().waitFor();
    const wrap = p.locator(".audit-log .table-wrap");
    expect(await wrap.evaluate((el) => el.scrollWidth <= el.clientWidth + 1)).toBe(true);
    await shot(p, "05-audit");
    await logOut(p);
  });

  it("lets the tenant admin create a key whose traffic shows on the dashboard", async () => {
    const p = await page();
    await logIn(p, "acme-admin", ADMIN_PASSWORD);
    await p.getByRole("heading", { name: "Usage" }).waitFor();
    await p.getByRole("link", { name: "Keys" }).first().click();
    await p.getByRole("button", { name: "Create key" }).click();
    await p.getByLabel("Name").fill("ci");
    await p.getByRole("button", { name: "Create", exact: true }).click();
    const secret = p.locator("[data-secret]");
    await secret.waitFor();
    oldSecret = (await secret.textContent())!.trim();
    expect(oldSecret).toMatch(/^sk-cachet-[0-9A-Za-z]{40}$/);
    await shot(p, "06-key-created");
    await p.getByRole("button", { name: "I have stored it" }).click();
    await p.getByRole("cell", { name: "active" }).waitFor();
    await shot(p, "07-keys");

    // Official SDK traffic: the first request writes the prefix, the second reads it.
    const first = await ask(oldSecret);
    expect(first.usage.cache_creation_input_tokens).toBeGreaterThan(0);
    const second = await ask(oldSecret);
    expect(second.usage.cache_read_input_tokens).toBeGreaterThan(0);

    // The dashboard shows it once the rollups catch up (about a second here).
    await p.getByRole("link", { name: "Dashboard" }).first().click();
    await eventually("the dashboard shows the two requests", 60_000, async () => {
      await p.getByRole("button", { name: "Refresh" }).click();
      await p.waitForTimeout(300);
      const n = await p.locator('[data-kpi="Requests"]').textContent();
      return n?.trim() === "2" ? true : undefined;
    });
    const ratio = (await p.locator('[data-kpi="Hit ratio"]').textContent())!;
    expect(Number.parseFloat(ratio)).toBeGreaterThan(0);
    const saved = (await p.locator('[data-kpi="Cost"]').textContent())!;
    expect(saved).toMatch(/^\$\d/);
    await p.locator('[data-chart="Tokens by class"] canvas').waitFor();
    await shot(p, "08-dashboard");
    // Usable on a narrow window: nothing wider than the screen.
    await p.setViewportSize({ width: 390, height: 844 });
    await p.waitForTimeout(300);
    const overflow = await p.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    expect(overflow).toBeLessThanOrEqual(0);
    await shot(p, "09-dashboard-narrow");
    await p.setViewportSize({ width: 1280, height: 900 });
    await p.getByRole("link", { name: "Cache" }).first().click();
    await p.getByRole("heading", { name: "Cache" }).waitFor();
    expect(await p.locator('[data-tier-bytes="dram"]').textContent()).not.toBe("0 B");
    await shot(p, "10-cache");
  });

  it("rotates a key: the old secret works during the grace period and not after", async () => {
    const p = await page();
    await logIn(p, "acme-admin", ADMIN_PASSWORD);
    await p.getByRole("link", { name: "Keys" }).first().click();
    await p.getByRole("button", { name: /^Rotate ci/ }).click();
    await p.getByLabel("Grace period (hours)").fill("0.004"); // 14 seconds
    await p.getByRole("button", { name: "Rotate", exact: true }).click();
    const secret = p.locator("[data-secret]");
    await secret.waitFor();
    newSecret = (await secret.textContent())!.trim();
    expect(newSecret).not.toBe(oldSecret);
    const rotatedAt = Date.now();
    await p.getByRole("button", { name: "I have stored it" }).click();
    await p.getByRole("cell", { name: "rotating" }).waitFor();
    await shot(p, "11-keys-rotated");
    expect(await status(ask(oldSecret))).toBe(200);
    expect(await status(ask(newSecret))).toBe(200);
    await new Promise((r) => setTimeout(r, Math.max(0, rotatedAt + 16_000 - Date.now())));
    expect(await status(ask(oldSecret))).toBe(401);
    expect(await status(ask(newSecret))).toBe(200);
  });

  it("revokes a key: refused within 5 seconds", async () => {
    const p = await page();
    await logIn(p, "acme-admin", ADMIN_PASSWORD);
    await p.getByRole("link", { name: "Keys" }).first().click();
    // Cached by the gateway as valid right before the revocation.
    expect(await status(ask(newSecret))).toBe(200);
    await p.getByRole("button", { name: /^Revoke ci/ }).first().click();
    await p.getByRole("button", { name: "Revoke", exact: true }).click();
    await p.getByText(/revoked\./).waitFor();
    await eventually("the revoked key is refused", 5_000, async () =>
      (await status(ask(newSecret))) === 401 ? true : undefined,
    );
  });

  it("lets the tenant admin make a workspace with its own limit and key (its own cache), and an alert endpoint", async () => {
    const p = await page();
    await logIn(p, "acme-admin", ADMIN_PASSWORD);
    await p.getByRole("link", { name: "Workspaces" }).first().click();
    await p.getByRole("button", { name: "Create workspace" }).click();
    await p.getByLabel("Name").fill("research");
    await p.getByLabel("Requests per minute").fill("100");
    await p.getByLabel(/^Monthly budget/).fill("12.50");
    await p.getByRole("button", { name: "Save" }).click();
    const row = p.locator('tr[data-workspace="research"]');
    await row.waitFor();
    expect(await row.textContent()).toContain("100");
    expect(await row.textContent()).toContain("$12.50");
    await shot(p, "11-workspaces");
    await p.getByRole("link", { name: "Keys" }).first().click();
    await p.getByRole("button", { name: "Create key" }).click();
    await p.getByLabel("Name").fill("research-key");
    await p.getByLabel("Workspace").selectOption({ label: "research" });
    await p.getByRole("button", { name: "Create", exact: true }).click();
    const secret = p.locator("[data-secret]");
    await secret.waitFor();
    const researchKey = (await secret.textContent())!.trim();
    await p.getByRole("button", { name: "I have stored it" }).click();
    await p.locator("tr", { hasText: "research-key" }).getByRole("cell", { name: "research", exact: true }).waitFor();
    // The default workspace cached this prompt; the research workspace does not read it.
    const r = await ask(researchKey);
    expect(r.usage.cache_read_input_tokens).toBe(0);
    expect(r.usage.cache_creation_input_tokens).toBeGreaterThan(0);
    // Its usage is its own on the dashboard.
    await p.getByRole("link", { name: "Dashboard" }).first().click();
    await p.getByLabel("Split by").selectOption("workspace");
    await eventually("the dashboard splits usage by workspace", 30_000, async () => {
      await p.getByRole("button", { name: "Refresh" }).click();
      await p.waitForTimeout(300);
      const row = p.locator("tr", { has: p.getByRole("rowheader", { name: "research", exact: true }) });
      return (await row.count()) > 0 && (await row.locator("td").first().textContent())?.trim() === "1" ? true : undefined;
    });

    await p.getByRole("link", { name: "Alerts" }).first().click();
    await p.getByRole("button", { name: "Add endpoint" }).click();
    await p.getByLabel("URL").fill("https://alerts.example.com/cachet");
    await p.getByRole("button", { name: "Add", exact: true }).click();
    await secret.waitFor();
    expect((await secret.textContent())!.trim()).toMatch(/^whsec_[0-9a-f]{64}$/);
    await p.getByRole("button", { name: "I have stored it" }).click();
    await p.locator('tr[data-endpoint="https://alerts.example.com/cachet"]').waitFor();
  });

  it("applies requests per minute set by the tenant admin: the third request gets 429 quoting it", async () => {
    const p = await page();
    await logIn(p, "acme-admin", ADMIN_PASSWORD);
    await p.getByRole("link", { name: "Keys" }).first().click();
    await p.getByRole("button", { name: "Create key" }).click();
    await p.getByLabel("Name").fill("load");
    await p.getByRole("button", { name: "Create", exact: true }).click();
    const key = (await p.locator("[data-secret]").textContent())!.trim();
    await p.getByRole("button", { name: "I have stored it" }).click();
    await p.getByRole("link", { name: "Quotas & policy" }).first().click();
    // The form checks before sending.
    await p.getByLabel("Requests per minute", { exact: true }).fill("0");
    await p.getByRole("button", { name: "Save policy" }).click();
    await p.getByText("a whole number of at least 1, or empty for no limit").first().waitFor();
    await p.getByLabel("Requests per minute", { exact: true }).fill("2");
    await p.getByRole("button", { name: "Save policy" }).click();
    await p.getByText("Saved.").waitFor();
    await shot(p, "12-policy");
    // The tenant admin may not raise the platform's limits.
    const tok = await token("acme-admin", ADMIN_PASSWORD);
    const denied = await adminApi(tok, "PATCH", `/v1/admin/tenants/${acmeId}/policy`, { cache_resident_bytes: 1 });
    expect(denied.status).toBe(403);
    expect(denied.body.error.message).toContain("cache_resident_bytes");
    // Within 5 s every gateway has it.
    await new Promise((r) => setTimeout(r, 5_000));
    expect(await status(ask(key, "one"))).toBe(200);
    expect(await status(ask(key, "two"))).toBe(200);
    let third: unknown;
    try {
      await ask(key, "three");
    } catch (e) {
      third = e;
    }
    expect(third).toBeInstanceOf(Anthropic.RateLimitError);
    expect((third as Error).message).toContain("2 requests per minute");
    // The refusal is counted on the dashboard's budget panel.
    await p.getByRole("link", { name: "Dashboard" }).first().click();
    await eventually("the refusal is counted", 30_000, async () => {
      await p.getByRole("button", { name: "Refresh" }).click();
      await p.waitForTimeout(300);
      const n = p.locator('[data-refusals="requests_per_minute"]');
      return (await n.count()) > 0 && (await n.textContent()) === "1" ? true : undefined;
    });
  });

  it("holds the platform's ceilings in the console and gives one key its own limit", async () => {
    const p = await page();
    await logIn(p, "root", ROOT_PASSWORD);
    await p.getByRole("link", { name: ACME }).click();
    await p.getByRole("link", { name: "Quotas & policy" }).first().click();
    await p.getByRole("group", { name: "Ceilings (platform admins only)" }).waitFor();
    await p.getByLabel("Requests per minute (empty = no ceiling)").fill("10");
    await p.getByLabel("The tenant may allow 1-hour cache TTLs").uncheck();
    await p.getByRole("button", { name: "Save policy" }).click();
    await p.getByText("Saved.").waitFor();
    await logOut(p);
    // The tenant admin sees each ceiling beside its field and cannot go above it.
    await logIn(p, "acme-admin", ADMIN_PASSWORD);
    await p.getByRole("link", { name: "Quotas & policy" }).first().click();
    await p.getByText("Ceiling set by the platform: at most 10.").first().waitFor();
    expect(await p.getByRole("group", { name: "Ceilings (platform admins only)" }).count()).toBe(0);
    expect(await p.getByRole("switch", { name: "Allow 1-hour cache TTLs (billed at 2× input for writes)" }).isDisabled()).toBe(true);
    await p.getByText("The platform does not allow 1-hour TTLs for this tenant.").waitFor();
    await p.getByLabel("Requests per minute", { exact: true }).fill("11");
    await p.getByRole("button", { name: "Save policy" }).click();
    await p.getByText("at most 10 (the platform's ceiling)").waitFor();
    await shot(p, "12b-policy-ceilings");
    // One key gets its own limit: the form keeps it within the tenant's (2 a minute).
    await p.getByRole("link", { name: "Keys" }).first().click();
    const row = p.locator("tr", { hasText: "load" }).first();
    await row.getByRole("button", { name: /^Set limits and tags of load/ }).click();
    await p.getByLabel("Requests per minute").fill("5");
    await p.getByLabel("Tags (tag=value, comma-separated)").fill("team");
    await p.getByRole("button", { name: "Save", exact: true }).click();
    await p.getByText("at most 2 (the tenant's limit)").waitFor();
    await p.getByText('"team": write each tag as tag=value').waitFor();
    await p.getByLabel("Requests per minute").fill("1");
    await p.getByLabel("Tags (tag=value, comma-separated)").fill("team=search, env=prod");
    await p.getByRole("button", { name: "Save", exact: true }).click();
    await p.getByText(/Limits and tags of .* saved/).waitFor();
    await row.getByRole("cell", { name: "1 req/min" }).waitFor();
    await row.getByRole("cell", { name: "env=prod, team=search" }).waitFor();
    await shot(p, "12c-key-limits");
    // The dashboard splits the key's earlier traffic by its tag.
    await p.getByRole("link", { name: "Dashboard" }).first().click();
    await p.getByLabel("Split by").selectOption("tag:team");
    await p.getByRole("rowheader", { name: "search", exact: true }).waitFor();
    await shot(p, "12d-split-by-tag");
    // Put the tenant back as the later steps expect it.
    const root = await token("root", ROOT_PASSWORD);
    const back = await adminApi(root, "PATCH", `/v1/admin/tenants/${acmeId}/policy`, {
      ceilings: { requests_per_minute: null, allow_1h_ttl: true },
      allow_1h_ttl: true,
    });
    expect(back.status).toBe(200);
    expect(back.body.requests_per_minute).toBe(2);
  });

  it("shows another tenant's admin nothing of the first, in the UI or the API", async () => {
    const p = await page();
    await logIn(p, "globex-admin", OTHER_PASSWORD);
    await p.getByRole("heading", { name: GLOBEX }).waitFor();
    expect(await p.getByText(ACME).count()).toBe(0);
    await p.goto(`${svc.url}/admin/#/tenants/${acmeId}/keys`);
    await p.getByRole("alert").filter({ hasText: "not found" }).waitFor();
    expect(await p.getByText(ACME).count()).toBe(0);
    await shot(p, "13-other-tenant");
    const tok = await token("globex-admin", OTHER_PASSWORD);
    for (const path of [
      `/v1/admin/tenants/${acmeId}`,
      `/v1/admin/tenants/${acmeId}/keys`,
      `/v1/admin/tenants/${acmeId}/usage?from=2026-01-01T00:00:00Z&to=2030-01-01T00:00:00Z`,
      `/v1/admin/tenants/${acmeId}/cache`,
      `/v1/admin/tenants/${acmeId}/budget`,
      `/v1/admin/tenants/${acmeId}/policy`,
      `/v1/admin/audit?tenant=${acmeId}`,
    ]) {
      const r = await adminApi(tok, "GET", path);
      expect(r.status, path).toBe(404);
    }
    const own = await adminApi(tok, "GET", "/v1/admin/tenants");
    expect(own.body.data.map((t: { id: string }) => t.id)).toEqual([globexId]);
    const audit = await adminApi(tok, "GET", "/v1/admin/audit");
    expect(audit.body.data.every((r: { tenant_id: string }) => r.tenant_id === globexId)).toBe(true);
    const usage = await adminApi(tok, "GET", "/v1/billing/usage?from=2026-01-01T00:00:00Z&to=2030-01-01T00:00:00Z&group_by=tenant");
    expect(usage.body.data.every((r: { tenant: string }) => r.tenant === globexId)).toBe(true);
  });

  it("lets finance rate an invoice and download a CSV whose rows are the ledger's", async () => {
    const p = await page();
    await logIn(p, "fin", FIN_PASSWORD);
    await p.getByRole("link", { name: "Finance" }).first().click();
    await p.getByLabel("Rate the draft of").selectOption({ label: ACME });
    await p.getByRole("button", { name: "Rate draft" }).click();
    await p.getByText(/^Draft for /).waitFor();
    await p.getByRole("link", { name: new Date().toISOString().slice(0, 7) }).first().click();
    await p.getByRole("heading", { name: /^Invoice / }).waitFor();
    await shot(p, "14-invoice");
    const invoiceTotal = (await p.locator("tfoot td").last().textContent())?.trim();
    // The invoice downloads as CSV: a row per line and the total, the page's total.
    const [invCsv] = await Promise.all([
      p.waitForEvent("download"),
      p.getByRole("button", { name: "Download invoice CSV" }).click(),
    ]);
    const invText = (await import("node:fs")).readFileSync((await invCsv.path())!, "utf8");
    const invRows = invText.split("\r\n").filter((l) => l.length > 0);
    expect(invRows[0]).toBe("line,kind,model,token_class,price_from,quantity,exact_nanos,amount,description");
    const totalRow = invRows[invRows.length - 1].split(",");
    expect(totalRow[1]).toBe("total");
    expect(`$${totalRow[7]}`).toBe(invoiceTotal);
    // And as a PDF to send: rendered to PNG (poppler's pdftoppm) and its text read back
    // (pdftotext): the total is the page's, to the cent.
    const [invPdf] = await Promise.all([
      p.waitForEvent("download"),
      p.getByRole("button", { name: "Download invoice PDF" }).click(),
    ]);
    const fs = await import("node:fs");
    const { execFileSync } = await import("node:child_process");
    const pdfPath = (await invPdf.path())!;
    expect(fs.readFileSync(pdfPath).subarray(0, 5).toString()).toBe("%PDF-");
    const png = `${ARTIFACTS}/14b-invoice-pdf`;
    execFileSync("pdftoppm", ["-png", "-r", "80", "-singlefile", "-f", "1", "-l", "1", pdfPath, png]);
    expect(fs.statSync(`${png}.png`).size).toBeGreaterThan(5_000);
    const pdfText = execFileSync("pdftotext", ["-layout", pdfPath, "-"], { encoding: "utf8" });
    expect(pdfText).toContain(`Total ${totalRow[7]} USD`);
    expect(pdfText).toContain(ACME);
    // One rounding rule in all four documents (billing/src/rounding.rs): each line's amount
    // is the same text on the page, in the JSON, the CSV and the PDF, and the amounts with the
    // rounding row add up to the total exactly (in integers, as a spreadsheet would).
    const invoiceId = p.url().split("/").pop()!;
    const json = (await adminApi(await token("fin", FIN_PASSWORD), "GET", `/v1/billing/invoices/${invoiceId}`)).body;
    const jsonAmounts: string[] = json.lines.map((l: { amount: string }) => l.amount);
    expect(jsonAmounts.length).toBeGreaterThan(0);
    const pageAmounts = (await p.locator("tbody tr[data-line] td.amount").allTextContents()).map((t) => t.trim());
    const pageRounding = (await p.locator("tbody tr[data-rounding] td.amount").textContent())?.trim();
    const csvRows = invRows.slice(1).map((r) => r.split(","));
    const csvAmounts = csvRows.filter((r) => r[1] !== "rounding" && r[1] !== "total").map((r) => r[7]);
    const csvRounding = csvRows.find((r) => r[1] === "rounding")?.[7];
    expect(pageAmounts).toEqual(jsonAmounts);
    expect(csvAmounts).toEqual(jsonAmounts);
    expect(pageRounding).toBe(json.rounding.amount);
    expect(csvRounding).toBe(json.rounding.amount);
    for (const a of [...jsonAmounts, json.rounding.amount]) expect(pdfText).toContain(a);
    const atto = (s: string) => {
      const [w, f = ""] = s.replace(/^-/, "").split(".");
      const v = BigInt(w) * 10n ** 18n + BigInt(f.padEnd(18, "0"));
      return s.startsWith("-") ? -v : v;
    };
    const summed = [...csvAmounts, csvRounding!].reduce((a, s) => a + atto(s), 0n);
    expect(summed).toBe(atto(json.total));
    expect(`$${json.total}`).toBe(invoiceTotal);
    expect(json.lines.reduce((a: number, l: { amount_minor: number }) => a + l.amount_minor, 0)).toBe(json.total_minor);
    // Rating the draft again keeps the total (no new usage) and says when it was rated.
    await p.getByRole("button", { name: "Rate again" }).click();
    await p.getByText(/ · rated \d{4}-\d{2}-\d{2} /).waitFor();
    expect((await p.locator("tfoot td").last().textContent())?.trim()).toBe(invoiceTotal);
    // The month is not over: Finalize is not offered yet, and the page says from when.
    expect(await p.getByRole("button", { name: "Finalize…" }).isDisabled()).toBe(true);
    await p.getByText(/is not over: it can be finalized from \d{4}-\d{2}-01 \(UTC\)/).waitFor();
    await p.getByRole("link", { name: "← Invoices" }).click();
    // The month overview lists ACME with the invoice's total (one rounding for both), and
    // its CSV downloads with the tenant's name.
    const acmeRow = p.locator("section[aria-labelledby=overview-title] tbody tr", { hasText: ACME });
    const acmeCost = await eventually("ACME in the month overview", 10_000, async () => {
      const t = (await acmeRow.locator("td").nth(6).textContent({ timeout: 1000 }))?.trim();
      return t || undefined;
    });
    expect(acmeCost).toBe(invoiceTotal);
    const [overviewCsv] = await Promise.all([
      p.waitForEvent("download"),
      p.getByRole("button", { name: "Download overview CSV" }).click(),
    ]);
    const ov = (await import("node:fs")).readFileSync((await overviewCsv.path())!, "utf8");
    expect(ov.split("\r\n")[0]).toMatch(/^tenant_id,tenant,state,requests,/);
    expect(ov).toContain(`,${ACME},active,`);
    await shot(p, "15-finance");
    const [download] = await Promise.all([
      p.waitForEvent("download"),
      p.getByRole("button", { name: "Download CSV" }).click(),
    ]);
    const path = await download.path();
    const csv = (await import("node:fs")).readFileSync(path!, "utf8");
    const lines = csv.split("\r\n").filter((l) => l.length > 0);
    expect(lines[0]).toMatch(/^request_id,tenant_id,workspace_id,api_key_id,model,/);
    const rows = lines.slice(1).map((l) => l.split(",").slice(0, 11).join(","));
    const ledger = svc
      .sql(
        "SELECT request_id, tenant_id, workspace_id, api_key_id, model, input_tokens, cache_write_5m_tokens, " +
          "cache_write_1h_tokens, cache_read_tokens, output_tokens, status FROM usage_events ORDER BY started_at, request_id",
      )
      .map((r) => r.join(","));
    expect(ledger.length).toBeGreaterThanOrEqual(8);
    expect(rows).toEqual(ledger);
    // The file says its filter: every tenant here; then one tenant's one key, chosen by name
    // (finance lists keys, never their secrets), whose rows are that key's alone.
    expect(download.suggestedFilename()).toMatch(/^cachet-usage-all-tenants-\d{4}-\d{2}-\d{2}-\d{4}-\d{2}-\d{2}\.csv$/);
    await p.locator("#inv-tenant").selectOption({ label: ACME });
    const keyPick = p.locator("#exp-key");
    await eventually("ACME's keys in the export form", 10_000, async () => ((await keyPick.locator("option").count()) > 1 ? true : undefined));
    await keyPick.selectOption({ index: 1 });
    const keyId = await keyPick.inputValue();
    const keyName = ((await keyPick.locator(`option[value="${keyId}"]`).textContent()) ?? "").trim();
    const [byKey] = await Promise.all([p.waitForEvent("download"), p.getByRole("button", { name: "Download CSV" }).click()]);
    const safe = (s: string) => s.replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "");
    expect(byKey.suggestedFilename()).toContain(`cachet-usage-${safe(ACME)}-`);
    expect(byKey.suggestedFilename()).toContain(`-${safe(keyName)}-`);
    const keyRows = (await import("node:fs"))
      .readFileSync((await byKey.path())!, "utf8")
      .split("\r\n")
      .filter((l) => l.length > 0)
      .slice(1);
    expect(keyRows.every((l) => l.split(",")[3] === keyId)).toBe(true);
    // The same filter as a FOCUS 1.2 dataset: its mandatory columns, that key as the resource.
    const [focus] = await Promise.all([p.waitForEvent("download"), p.getByRole("button", { name: "FOCUS 1.2" }).click()]);
    expect(focus.suggestedFilename()).toContain(`cachet-focus-${safe(ACME)}-`);
    const [head, ...charges] = (await import("node:fs"))
      .readFileSync((await focus.path())!, "utf8")
      .split("\r\n")
      .filter((l) => l.length > 0)
      .map((l) => l.split(","));
    for (const c of ["BilledCost", "BillingAccountId", "ChargeCategory", "EffectiveCost", "ListCost", "ServiceName", "PricingUnit"]) {
      expect(head).toContain(c);
    }
    expect(charges.length).toBeGreaterThan(0);
    const cell = (r: string[], c: string) => r[head.indexOf(c)];
    expect(charges.every((r) => cell(r, "ResourceId") === keyId && cell(r, "BillingAccountId") === acmeId)).toBe(true);
  });

  it("resets a forgotten password with a one-time secret, then the user changes it on their account page", async () => {
    const p = await page();
    await logIn(p, "root", ROOT_PASSWORD);
    await p.getByRole("link", { name: "Users" }).first().click();
    await p.getByRole("button", { name: "Reset the password of globex-admin" }).click();
    await p.getByRole("button", { name: "Make a reset secret" }).click();
    const secret = ((await p.locator("[data-secret]").textContent()) ?? "").trim();
    expect(secret).toMatch(/^cachet-reset-[0-9a-f]{64}$/);
    await shot(p, "16-reset-secret");
    await p.getByRole("button", { name: "I have stored it" }).click();
    await logOut(p);
    // The user redeems it on the login page (a mistyped confirmation is caught first).
    const reset = "globex-reset-password-e2e";
    await p.getByRole("button", { name: "I have a reset secret" }).click();
    await p.getByLabel("Reset secret").fill(secret);
    await p.getByLabel("New password (12+ characters)").fill(reset);
    await p.getByLabel("New password, again").fill(reset + "x");
    await p.getByRole("button", { name: "Set password" }).click();
    await p.getByText("the two passwords differ").waitFor();
    await p.getByLabel("New password, again").fill(reset);
    await p.getByRole("button", { name: "Set password" }).click();
    await p.getByText("Password set. Log in with it.").waitFor();
    await shot(p, "17-reset-done");
    // The secret worked once; the old password no longer does.
    const again = await fetch(`${svc.url}/v1/admin/password-reset`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ reset_secret: secret, new_password: "another-password-123" }),
    });
    expect(again.status).toBe(400);
    const old = await fetch(`${svc.url}/v1/admin/login`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ username: "globex-admin", password: OTHER_PASSWORD }),
    });
    expect(old.status).toBe(401);
    await new Promise((r) => setTimeout(r, 1100)); // the backoff after that failure
    await logIn(p, "globex-admin", reset);
    await p.getByRole("link", { name: /globex-admin/ }).click();
    await p.getByRole("heading", { name: "Your account" }).waitFor();
    await p.getByLabel("Current password").fill(reset);
    await p.getByLabel("New password (12+ characters)").fill("globex-changed-password");
    await p.getByLabel("New password, again").fill("globex-changed-password");
    await p.getByRole("button", { name: "Change password" }).click();
    await p.getByText("Password changed. Your other sessions have been logged out.").waitFor();
    await shot(p, "18-account");
    await logOut(p);
    await logIn(p, "globex-admin", "globex-changed-password");
  });

  it("keeps a price book: shipped defaults listed, the platform admin schedules a price, finance reads it", async () => {
    const p = await page();
    await logIn(p, "root", ROOT_PASSWORD);
    await p.getByRole("link", { name: "Finance" }).first().click();
    await p.getByRole("link", { name: "Price book" }).click();
    await p.getByRole("heading", { name: "Price book" }).waitFor();
    // Every served model has a price from the start: the shipped defaults.
    await p.locator("tr", { hasText: "always (shipped default)" }).first().waitFor();
    // A price in the past is a correction: the form asks first.
    await p.getByLabel("Model", { exact: true }).fill("sim-llama-8b");
    await p.getByLabel("In force from (UTC)").fill("2026-01-01T00:00");
    await p.getByLabel("Input, per million tokens").fill("0.25");
    await p.getByLabel("Output, per million tokens").fill("0.5");
    await p.getByRole("button", { name: "Record the correction" }).click();
    await p.getByText("in the past: tick the correction box").waitFor();
    await p.getByLabel("In force from (UTC)").fill("2030-01-01T00:00");
    await p.getByLabel("Cache object held, per hour (× input)").fill("0.5");
    await p.getByRole("button", { name: "Add price" }).click();
    await p.getByText(/^Price of sim-llama-8b from .* recorded\.$/).waitFor();
    const scheduled = p.locator('tr[data-state="scheduled"]', { hasText: "sim-llama-8b" });
    await scheduled.waitFor();
    expect(await scheduled.textContent()).toContain("0.250 USD");
    expect(await scheduled.textContent()).toContain("0.50×");
    // A version scheduled by mistake is retired before it takes effect.
    await p.getByLabel("Model", { exact: true }).fill("sim-llama-8b");
    await p.getByLabel("In force from (UTC)").fill("2031-01-01T00:00");
    await p.getByLabel("Input, per million tokens").fill("9");
    await p.getByLabel("Output, per million tokens").fill("9");
    await p.getByRole("button", { name: "Add price" }).click();
    await p.getByRole("button", { name: /^Retire sim-llama-8b from 2031/ }).click();
    await p.getByRole("button", { name: "Retire", exact: true }).click();
    await p.locator('tr[data-state="retired"]', { hasText: "sim-llama-8b" }).waitFor();
    await shot(p, "19-prices");
    await logOut(p);
    // Finance reads the same book and cannot edit it.
    await logIn(p, "fin", FIN_PASSWORD);
    await p.getByRole("link", { name: "Finance" }).first().click();
    await p.getByRole("link", { name: "Price book" }).click();
    await p.getByRole("heading", { name: "Price book" }).waitFor();
    await p.locator('tr[data-state="scheduled"]', { hasText: "sim-llama-8b" }).waitFor();
    expect(await p.getByRole("button", { name: "Add price" }).count()).toBe(0);
  });

  it("warns the tenant admin on the dashboard once the month's budget is reached", async () => {
    const tok = await token("root", ROOT_PASSWORD);
    const r = await adminApi(tok, "PATCH", `/v1/admin/tenants/${acmeId}/policy`, { monthly_budget_minor: 0 });
    expect(r.status).toBe(200);
    const p = await page();
    await logIn(p, "acme-admin", ADMIN_PASSWORD);
    await p.locator("[data-budget-banner=exhausted]").waitFor();
    // The tenant admin exports its own ledger rows from its dashboard: only its tenant's.
    const [own] = await Promise.all([
      p.waitForEvent("download"),
      p.getByRole("button", { name: "Export ledger rows (CSV)" }).click(),
    ]);
    const ownRows = (await import("node:fs"))
      .readFileSync((await own.path())!, "utf8")
      .split("\r\n")
      .filter((l) => l.length > 0)
      .slice(1);
    expect(ownRows.length).toBeGreaterThan(0);
    expect(ownRows.every((l) => l.split(",")[1] === acmeId)).toBe(true);
    expect(await p.locator("[data-budget-banner=exhausted]").textContent()).toMatch(/Monthly budget reached: \$[\d.,]+ of \$0\.00 spent/);
    await shot(p, "20-budget");
    // The budget alerts were queued for the tenant's endpoint at once: the log shows them.
    await p.getByRole("link", { name: "Alerts" }).first().click();
    await eventually("the 100% alert is in the delivery log", 20_000, async () => {
      await p.getByRole("button", { name: "Refresh" }).click();
      await p.waitForTimeout(300);
      return (await p.locator('tr[data-delivery$=":100"]').count()) > 0 ? true : undefined;
    });
    await shot(p, "21-alerts");
  });

  it("lets a tenant admin list cache objects, extend one, delete one and purge the whole cache", async () => {
    // Another tenant's admin, so that nothing earlier in the story (acme's limits and budget)
    // stands in the way of the traffic.
    const root = await token("root", ROOT_PASSWORD);
    const k = await adminApi(root, "POST", `/v1/admin/tenants/${globexId}/keys`, { name: "objects" });
    expect(k.status).toBe(201);
    const client = sdk(k.body.secret);
    type Obj = { id: string; input_tokens: number };
    const made: Obj[] = [];
    for (const name of ["handbook", "contract"]) {
      made.push(
        await client.post<Obj>("/v1/caches", {
          body: { model: "sim-tiny", display_name: name, system: `${name}: ${SYSTEM}`, ttl: "2h" },
        }),
      );
    }
    // Used by id through the SDK (extra body field): read from the cache.
    const used = await client.messages.create({
      model: "sim-tiny",
      max_tokens: 4,
      messages: [{ role: "user", content: "What does it say?" }],
      // @ts-expect-error: a Cachet field the SDK's types do not know
      cached_content: made[0].id,
    });
    expect(used.usage.cache_read_input_tokens).toBe(made[0].input_tokens);

    const u = await adminApi(root, "POST", "/v1/admin/users", {
      username: "globex-cache-admin",
      password: OTHER_PASSWORD,
      role: "tenant_admin",
      tenant: globexId,
    });
    expect(u.status).toBe(201);
    const p = await page();
    await logIn(p, "globex-cache-admin", OTHER_PASSWORD);
    await p.getByRole("link", { name: "Cache" }).first().click();
    const row = (o: Obj) => p.locator(`tr[data-object="${o.id}"]`);
    await row(made[0]).waitFor();
    await row(made[1]).waitFor();
    expect(await row(made[0]).textContent()).toContain("handbook");
    expect(await row(made[0]).textContent()).toContain("default");
    await shot(p, "22-cache-objects");
    // Extended to a day from now: the API key sees the new expiry too.
    await p.getByRole("button", { name: `Extend ${made[1].id}` }).click();
    // Only what the tenant's policy allows is offered (a day at most, by default).
    const offered = await p.getByLabel("Held until, from now").locator("option").evaluateAll((os) => os.map((o) => (o as HTMLOptionElement).value));
    expect(offered).toEqual(["1h", "24h"]);
    await p.getByLabel("Held until, from now").selectOption("24h");
    await p.getByRole("button", { name: "Extend", exact: true }).click();
    await p.getByText(`Cache object ${made[1].id} now expires`).waitFor();
    const extended = await client.get<{ expires_at: string }>(`/v1/caches/${made[1].id}`);
    const left = Date.parse(extended.expires_at) - Date.now();
    expect(left).toBeGreaterThan(23 * 3600_000);
    expect(left).toBeLessThanOrEqual(24 * 3600_000);
    await p.getByRole("button", { name: `Delete ${made[0].id}` }).click();
    await p.getByRole("button", { name: "Delete", exact: true }).click();
    await p.getByText(`Cache object ${made[0].id} deleted.`).waitFor();
    expect(await row(made[0]).count()).toBe(0);
    expect(await status(client.get(`/v1/caches/${made[0].id}`))).toBe(404);

    await p.getByRole("button", { name: "Purge the whole cache" }).click();
    await p.getByRole("button", { name: "Purge", exact: true }).click();
    await p.getByText("Cache purged; 1 cache object(s) deleted.").waitFor();
    await p.getByText("No cache objects.").waitFor();
    expect(await status(client.get(`/v1/caches/${made[1].id}`))).toBe(404);
    // Every block leaves the node within the change feed's poll.
    await eventually("the purged cache holds no bytes", 10_000, async () => {
      await p.getByRole("button", { name: "Refresh" }).first().click();
      await p.waitForTimeout(300);
      return (await p.locator('[data-tier-bytes="dram"]').textContent()) === "0 B" ? true : undefined;
    });
    await shot(p, "23-cache-purged");
  });

  it("says on the dashboard why a cache write was not held (the tenant's quota)", async () => {
    const root = await token("root", ROOT_PASSWORD);
    const t = await adminApi(root, "POST", "/v1/admin/tenants", { name: `initech-${SUFFIX}` });
    expect(t.status).toBe(201);
    const id = t.body.id;
    expect((await adminApi(root, "PATCH", `/v1/admin/tenants/${id}/policy`, { cache_resident_bytes: 1 })).status).toBe(200);
    const k = await adminApi(root, "POST", `/v1/admin/tenants/${id}/keys`, { name: "app" });
    expect(k.status).toBe(201);
    const u = await adminApi(root, "POST", "/v1/admin/users", {
      username: "initech-admin",
      password: OTHER_PASSWORD,
      role: "tenant_admin",
      tenant: id,
    });
    expect(u.status).toBe(201);
    // Within a second every gateway has the quota; a new prefix's write is then refused (a
    // prompt of its own each time, so that no earlier write is read instead).
    let attempt = 0;
    await eventually("the quota refuses the write", 10_000, async () => {
      attempt += 1;
      const m = await sdk(k.body.secret).messages.create({
        model: "sim-tiny",
        max_tokens: 8,
        system: [{ type: "text", text: `${SYSTEM} Attempt ${attempt}.`, cache_control: { type: "ephemeral" } }],
        messages: [{ role: "user", content: "Will this be cached?" }],
      });
      return m.usage.cache_creation_input_tokens === 0 && m.usage.cache_read_input_tokens === 0 ? true : undefined;
    });
    const p = await page();
    await logIn(p, "initech-admin", OTHER_PASSWORD);
    const note = p.locator("[data-not-held]");
    await eventually("the dashboard says why", 30_000, async () => {
      await p.getByRole("button", { name: "Refresh" }).click();
      await p.waitForTimeout(300);
      return (await note.count()) > 0 ? true : undefined;
    });
    expect(await note.textContent()).toMatch(/^\d+ cache writes? (was|were) not held in this range.*over the tenant's cache quota/);
    await shot(p, "24-writes-not-held");
  });

  it("answers a malformed address with a sentence, not the parser's words", async () => {
    const p = await page();
    await logIn(p, "root", ROOT_PASSWORD);
    await p.evaluate(() => {
      window.location.hash = "/tenants/not-a-tenant";
    });
    await p.getByText(/^id: not an id \(a UUID such as/).first().waitFor();
    await shot(p, "25-malformed-address");
    expect(await p.getByText(/UUID parsing failed|Failed to deserialize/).count()).toBe(0);
    // And the finance API, asked without a format or with a bad one, names the field.
    const tok = await token("fin", FIN_PASSWORD);
    const day = new Date().toISOString().slice(0, 10);
    const missing = await adminApi(tok, "GET", `/v1/billing/exports/usage?from=${day}T00:00:00Z&to=${day}T23:00:00Z`);
    expect([missing.status, missing.body.error.message]).toEqual([400, "format: required"]);
    const bad = await adminApi(tok, "GET", `/v1/billing/exports/usage?from=${day}T00:00:00Z&to=${day}T23:00:00Z&format=xml`);
    expect(bad.body.error.message).toBe('format: "xml" is not one of csv, jsonl, cloudevents');
  });
});
