// Starts a real Cachet for the browser suite: a fresh database on the local Postgres, the local
// Redis, the `cachet` binary built by cargo (CACHET_BIN), and the built admin UI.

import { execFileSync, spawn, type ChildProcess } from "node:child_process";
import { mkdirSync, mkdtempSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium, type Browser, type Page } from "playwright-core";

export const ROOT = fileURLToPath(new URL("../..", import.meta.url));
export const BIN = process.env.CACHET_BIN ?? join(ROOT, "target", "debug", "cachet");
export const PG = process.env.CACHET_TEST_PG ?? "postgres://postgres@127.0.0.1:5432";
export const ARTIFACTS = join(ROOT, "admin-ui", "e2e-artifacts");
const SECRET = "e2e-admin-secret-of-at-least-thirty-two-bytes";

export function freePort(): Promise<number> {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.once("error", fail);
    s.listen(0, "127.0.0.1", () => {
      const a = s.address();
      const port = typeof a === "object" && a ? a.port : 0;
      s.close(() => ok(port));
    });
  });
}

export interface Service {
  url: string;
  db: string;
  env: NodeJS.ProcessEnv;
  proc: ChildProcess;
  log: string[];
  /** Run `cachet …` against the service's database. */
  cli(args: string[], input?: string): string;
  /** One SQL query's rows (psql, unaligned, `|`-separated). */
  sql(query: string): string[][];
  stop(): Promise<void>;
}

export async function startService(): Promise<Service> {
  const db = `cachet_e2e_${Date.now().toString(36)}_${Math.random().toString(36).slice(2, 8)}`;
  const port = await freePort();
  const data = mkdtempSync(join(tmpdir(), "cachet-e2e-"));
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    DATABASE_URL: `${PG}/${db}`,
    CACHET_LISTEN: `127.0.0.1:${port}`,
    CACHET_DATA_DIR: data,
    CACHET_ENGINE: "sim",
    CACHET_SIM_TIME_SCALE: "0",
    CACHET_ADMIN_JWT_SECRET: SECRET,
    CACHET_ADMIN_UI_DIR: join(ROOT, "admin-ui", "dist"),
    CACHET_ROLLUP_INTERVAL_SECS: "1",
    RUST_LOG: "warn",
  };
  const cli = (args: string[], input?: string) =>
    execFileSync(BIN, args, { env, input, encoding: "utf8", stdio: ["pipe", "pipe", "pipe"] }).trim();
  const sql = (query: string) =>
    execFileSync("psql", [`${PG}/${db}`, "-At", "-F", "|", "-c", query], { encoding: "utf8" })
      .split("\n")
      .filter((l) => l.length > 0)
      .map((l) => l.split("|"));
  cli(["migrate"]);
  const proc = spawn(BIN, ["serve"], { env, stdio: ["ignore", "pipe", "pipe"] });
  const log: string[] = [];
  proc.stdout?.on("data", (d) => log.push(String(d)));
  proc.stderr?.on("data", (d) => log.push(String(d)));
  const url = `http://127.0.0.1:${port}`;
  for (let i = 0; ; i++) {
    try {
      const r = await fetch(`${url}/readyz`);
      if (r.ok) break;
    } catch {
      // not up yet
    }
    if (i > 600 || proc.exitCode !== null) throw new Error(`cachet serve did not start:\n${log.join("")}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  return {
    url,
    db,
    env,
    proc,
    log,
    cli,
    sql,
    async stop() {
      proc.kill("SIGTERM");
      await new Promise((r) => proc.once("exit", r));
      try {
        execFileSync("psql", [`${PG}/postgres`, "-qc", `DROP DATABASE IF EXISTS "${db}" WITH (FORCE)`]);
      } catch {
        // best effort
      }
    },
  };
}

export async function launch(): Promise<Browser> {
  mkdirSync(ARTIFACTS, { recursive: true });
  return chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
}

/** A screenshot of the whole page, kept as a test artifact. */
export async function shot(page: Page, name: string): Promise<void> {
  await page.screenshot({ path: join(ARTIFACTS, `${name}.png`), fullPage: true });
}

/** Poll `f` until it returns a value that is not undefined, or fail after `ms`. */
export async function eventually<T>(what: string, ms: number, f: () => Promise<T | undefined>): Promise<T> {
  const deadline = Date.now() + ms;
  let last: unknown;
  for (;;) {
    try {
      const v = await f();
      if (v !== undefined) return v;
    } catch (e) {
      last = e;
    }
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms} ms${last ? ` (last error: ${last})` : ""}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}
