// The admin and finance APIs, with the login session.
//
// The access token lives in memory only; the refresh token in sessionStorage (this tab, until
// it is closed or the user logs out), so a reload keeps the login. A 401 is retried once after
// a refresh; if that fails the user is sent back to the login page.

export type Role = "platform_admin" | "tenant_admin" | "finance";

export interface Me {
  username: string;
  role: Role;
  tenant: string | null;
  tenant_name: string | null;
}

interface Tokens {
  access_token: string;
  refresh_token: string;
  expires_in: number;
  user: Me;
}

/** An error answer of the API, its message shown as it is. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly type: string,
    message: string,
  ) {
    super(message);
  }
}

const REFRESH_KEY = "cachet.refresh";
let access: string | null = null;
let me: Me | null = null;
const listeners = new Set<() => void>();

export function currentUser(): Me | null {
  return me;
}

/** Called whenever the login changes (login, logout, session ended). */
export function onSessionChange(f: () => void): () => void {
  listeners.add(f);
  return () => listeners.delete(f);
}

function set(t: Tokens | null) {
  access = t?.access_token ?? null;
  me = t?.user ?? null;
  if (t) sessionStorage.setItem(REFRESH_KEY, t.refresh_token);
  else sessionStorage.removeItem(REFRESH_KEY);
  listeners.forEach((f) => f());
}

async function errorOf(r: Response): Promise<ApiError> {
  let type = "api_error";
  let message = `${r.status} ${r.statusText}`;
  try {
    const body = await r.json();
    if (body?.error?.message) {
      type = body.error.type ?? type;
      message = body.error.message;
    }
  } catch {
    // not JSON: keep the status line
  }
  if (r.status === 429) {
    const after = r.headers.get("retry-after");
    if (after && !message.includes("seconds") && !message.includes("minutes")) {
      message = `${message} (retry after ${after} s)`;
    }
  }
  return new ApiError(r.status, type, message);
}

export async function login(username: string, password: string): Promise<Me> {
  const r = await fetch("/v1/admin/login", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ username, password }),
  });
  if (!r.ok) throw await errorOf(r);
  const t: Tokens = await r.json();
  set(t);
  return t.user;
}

let refreshing: Promise<boolean> | null = null;

/** Use the stored refresh token; whether a session is now active. */
export function refresh(): Promise<boolean> {
  refreshing ??= (async () => {
    const token = sessionStorage.getItem(REFRESH_KEY);
    if (!token) return false;
    try {
      const r = await fetch("/v1/admin/refresh", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ refresh_token: token }),
      });
      if (!r.ok) {
        set(null);
        return false;
      }
      set(await r.json());
      return true;
    } finally {
      refreshing = null;
    }
  })();
  return refreshing;
}

export async function logout(): Promise<void> {
  try {
    if (access) await fetch("/v1/admin/logout", { method: "POST", headers: auth() });
  } finally {
    set(null);
  }
}

function auth(): Record<string, string> {
  return access ? { authorization: `Bearer ${access}` } : {};
}

async function send(method: string, path: string, body?: unknown, headers?: Record<string, string>) {
  const init: RequestInit = { method, headers: { ...auth(), ...headers } };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    (init.headers as Record<string, string>)["content-type"] = "application/json";
  }
  let r = await fetch(path, init);
  if (r.status === 401 && (await refresh())) {
    init.headers = { ...(init.headers as Record<string, string>), ...auth() };
    r = await fetch(path, init);
  }
  if (r.status === 401) set(null);
  return r;
}

/** Call the API; the parsed JSON answer, or an ApiError. */
export async function api<T>(
  method: string,
  path: string,
  body?: unknown,
  headers?: Record<string, string>,
): Promise<T> {
  const r = await send(method, path, body, headers);
  if (!r.ok) throw await errorOf(r);
  // 204, or a 201 that carries nothing (a price version added).
  const text = r.status === 204 ? "" : await r.text();
  return (text ? JSON.parse(text) : undefined) as T;
}

/** Download an export as a file (the token cannot ride on a plain link). */
export async function download(path: string, filename: string): Promise<void> {
  const r = await send("GET", path);
  if (!r.ok) throw await errorOf(r);
  const url = URL.createObjectURL(await r.blob());
  const a = document.createElement("a");
  a.href = url;
  a.download = filename;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

/** A query string from defined values. */
export function qs(params: Record<string, string | number | boolean | null | undefined>): string {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") p.set(k, String(v));
  }
  const s = p.toString();
  return s ? `?${s}` : "";
}
