// Hash routing: every page is /admin/#/<path>, so the gateway serves one file.

import { useEffect, useState } from "preact/hooks";

export function currentPath(): string {
  const h = window.location.hash.replace(/^#/, "");
  return h.startsWith("/") ? h : "/";
}

export function navigate(path: string): void {
  if (currentPath() !== path) window.location.hash = path;
}

/** The current path, re-rendering on change. */
export function usePath(): string {
  const [path, setPath] = useState(currentPath());
  useEffect(() => {
    const f = () => setPath(currentPath());
    window.addEventListener("hashchange", f);
    return () => window.removeEventListener("hashchange", f);
  }, []);
  return path;
}

/** Match `/tenants/:id/keys` against a path; the named parts, or null. */
export function match(pattern: string, path: string): Record<string, string> | null {
  const p = pattern.split("/");
  const s = path.split("?")[0].split("/");
  if (p.length !== s.length) return null;
  const out: Record<string, string> = {};
  for (let i = 0; i < p.length; i++) {
    if (p[i].startsWith(":")) out[p[i].slice(1)] = decodeURIComponent(s[i]);
    else if (p[i] !== s[i]) return null;
  }
  return out;
}
