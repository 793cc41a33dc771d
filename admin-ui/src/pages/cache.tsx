import { api } from "../api";
import { ErrorBanner, Loading, Table, useAsync } from "../components/ui";
import { formatBytes, formatDuration, formatTokens } from "../format";
import type { CacheView, Tenant } from "../types";

const REASONS: [string, string][] = [
  ["expired", "TTL ran out"],
  ["evicted", "Evicted for capacity"],
  ["evicted_quota", "Evicted by the tenant's own quota"],
  ["demoted", "Moved from memory to disk (still cached)"],
  ["corrupt", "Dropped: failed its checksum"],
  ["purged", "Purged"],
];

export function CacheTab({ tenant }: { tenant: Tenant }) {
  const c = useAsync(() => api<CacheView>("GET", `/v1/admin/tenants/${tenant.id}/cache`), [tenant.id]);
  if (c.error) return <ErrorBanner error={c.error} />;
  if (!c.data) return <Loading what="the cache" />;
  const v = c.data;
  return (
    <section aria-labelledby="cache-title">
      <h2 id="cache-title">Cache</h2>
      <p>
        {formatBytes(v.total_bytes)} held on {v.nodes} node{v.nodes === 1 ? "" : "s"}
        {v.quota_bytes !== null ? ` of a ${formatBytes(v.quota_bytes)} quota` : " (no quota)"}
        {v.reserved_bytes !== null ? `, ${formatBytes(v.reserved_bytes)} reserved` : ""}.{" "}
        <button type="button" class="secondary outline" onClick={() => c.reload()}>
          Refresh
        </button>
      </p>
      {v.unreachable_nodes > 0 && <p role="alert">{v.unreachable_nodes} node(s) did not answer: their share is missing.</p>}
      <Table caption="Bytes per tier">
        <thead>
          <tr>
            <th scope="col">Tier</th>
            <th scope="col">Blocks</th>
            <th scope="col">Bytes</th>
            <th scope="col">Of quota</th>
          </tr>
        </thead>
        <tbody>
          {v.tiers.map((t) => {
            const share = v.quota_bytes ? Math.min(1, t.bytes / Math.max(1, v.quota_bytes)) : null;
            return (
              <tr key={t.tier}>
                <th scope="row">{t.tier}</th>
                <td>{t.blocks}</td>
                <td data-tier-bytes={t.tier}>{formatBytes(t.bytes)}</td>
                <td>
                  {share === null ? (
                    "–"
                  ) : (
                    <div class="bar" role="progressbar" aria-label={`${t.tier} share of quota`} aria-valuemin={0} aria-valuemax={100} aria-valuenow={Math.round(share * 100)}>
                      <span style={{ width: `${share * 100}%` }} />
                    </div>
                  )}
                </td>
              </tr>
            );
          })}
        </tbody>
      </Table>
      <Table caption="Blocks that left, by reason (since each node started)">
        <thead>
          <tr>
            <th scope="col">Reason</th>
            <th scope="col">Blocks</th>
          </tr>
        </thead>
        <tbody>
          {REASONS.map(([k, label]) => (
            <tr key={k}>
              <th scope="row">{label}</th>
              <td>{v.evictions[k] ?? 0}</td>
            </tr>
          ))}
        </tbody>
      </Table>
      <Table caption="Most-read prefixes (hashes only: Cachet never stores prompt text)">
        <thead>
          <tr>
            <th scope="col">Prefix (last block hash)</th>
            <th scope="col">Tokens</th>
            <th scope="col">Size</th>
            <th scope="col">Reads</th>
            <th scope="col">TTL left</th>
            <th scope="col">Kind</th>
          </tr>
        </thead>
        <tbody>
          {v.top_prefixes.length === 0 && (
            <tr>
              <td colSpan={6}>No cached prefix has been read yet.</td>
            </tr>
          )}
          {v.top_prefixes.map((p) => (
            <tr key={p.hash}>
              <td>
                <code class="hash" title={p.hash}>
                  {p.hash.slice(0, 16)}…
                </code>
              </td>
              <td>{formatTokens(p.tokens)}</td>
              <td>{formatBytes(p.bytes)}</td>
              <td>{p.reads}</td>
              <td>
                {formatDuration(p.ttl_left_ms)} of {p.ttl_secs >= 3600 ? "1h" : "5m"}
              </td>
              <td>{p.paid ? "breakpoint" : "automatic"}</td>
            </tr>
          ))}
        </tbody>
      </Table>
    </section>
  );
}
