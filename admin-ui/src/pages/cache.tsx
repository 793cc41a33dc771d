import { useState } from "preact/hooks";
import { api } from "../api";
import { Confirm, ErrorBanner, Loading, Notice, Table, useAsync } from "../components/ui";
import { count, formatBytes, formatDuration, formatTime, formatTokens, releasedText } from "../format";
import { extendChoices } from "../forms";
import type { CacheObject, CacheView, Tenant } from "../types";

const REASONS: [string, string][] = [
  ["expired", "TTL ran out"],
  ["evicted", "Evicted for capacity"],
  ["evicted_quota", "Evicted by the tenant's own quota"],
  ["demoted", "Moved from memory to disk (still cached)"],
  ["corrupt", "Dropped: failed its checksum"],
  ["purged", "Purged"],
];

export function CacheTab({ tenant, canEdit }: { tenant: Tenant; canEdit: boolean }) {
  const c = useAsync(() => api<CacheView>("GET", `/v1/admin/tenants/${tenant.id}/cache`), [tenant.id]);
  const [notice, setNotice] = useState<string | null>(null);
  const [purging, setPurging] = useState(false);
  // Bumped after a purge: the object list is read again.
  const [generation, setGeneration] = useState(0);
  if (c.error) return <ErrorBanner error={c.error} />;
  if (!c.data) return <Loading what="the cache" />;
  const v = c.data;
  const live = canEdit && tenant.state !== "deleted";
  return (
    <section aria-labelledby="cache-title">
      <h2 id="cache-title">Cache</h2>
      <p>
        {formatBytes(v.total_bytes)} held on {count(v.nodes, "node")}
        {v.nodes > 1 ? " (each node's copy counted)" : ""}
        {v.quota_bytes !== null ? ` of a ${formatBytes(v.quota_bytes)} quota (one copy of each block)` : " (no quota)"}
        {v.reserved_bytes !== null ? `, ${formatBytes(v.reserved_bytes)} reserved` : ""}.{" "}
        <button type="button" class="secondary outline" onClick={() => c.reload()}>
          Refresh
        </button>
      </p>
      {v.unreachable_nodes > 0 && <p role="alert">{v.unreachable_nodes} node(s) did not answer: their share is missing.</p>}
      <Notice text={notice} />
      <CacheObjects
        key={generation}
        tenant={tenant}
        canEdit={live}
        onChange={(text) => {
          setNotice(text);
          c.reload();
        }}
      />
      <Table caption="Bytes per tier" columns={["Tier", "Blocks", "Bytes", "Of quota"]}>
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
      <Table caption="Blocks that left, by reason (since each node started)" columns={["Reason", "Blocks"]}>
        <tbody>
          {REASONS.map(([k, label]) => (
            <tr key={k}>
              <th scope="row">{label}</th>
              <td>{v.evictions[k] ?? 0}</td>
            </tr>
          ))}
        </tbody>
      </Table>
      <Table
        caption="Most-read prefixes (hashes only: Cachet never stores prompt text)"
        columns={["Prefix (last block hash)", "Tokens", "Size", "Reads", "TTL left", "Kind"]}
      >
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
                {formatDuration(p.ttl_left_ms)} of {formatDuration(p.ttl_secs * 1000)}
              </td>
              <td>{p.paid ? "breakpoint" : "automatic"}</td>
            </tr>
          ))}
        </tbody>
      </Table>
      {live && (
        <p>
          <button type="button" class="danger" onClick={() => setPurging(true)}>
            Purge the whole cache
          </button>
        </p>
      )}
      <Confirm
        open={purging}
        title={`Purge ${tenant.name}'s cache?`}
        body={
          <p>
            Every cached prefix of every workspace is dropped from every node and tier within seconds, and every cache
            object is deleted (requests naming one get 404). The next requests compute their prefixes again. The tenant,
            its keys and its usage stay.
          </p>
        }
        action="Purge"
        danger
        onClose={() => setPurging(false)}
        onConfirm={async () => {
          const r = await api<{ cache_objects_deleted: number }>("POST", `/v1/admin/tenants/${tenant.id}/cache/purge`);
          setNotice(`Cache purged; ${r.cache_objects_deleted} cache object(s) deleted.`);
          setGeneration((g) => g + 1);
          c.reload();
        }}
      />
    </section>
  );
}


/** The tenant's cache objects (`POST /v1/caches`), newest first, each extendable and deletable. */
function CacheObjects(props: { tenant: Tenant; canEdit: boolean; onChange: (notice: string) => void }) {
  const { tenant } = props;
  const list = useAsync(
    () => api<{ data: CacheObject[]; has_more: boolean }>("GET", `/v1/admin/tenants/${tenant.id}/cache/objects?limit=100`),
    [tenant.id],
  );
  const [deleting, setDeleting] = useState<CacheObject | null>(null);
  const [extending, setExtending] = useState<CacheObject | null>(null);
  // Only the lifetimes the tenant's policy allows are offered (the server refuses longer).
  const policy = useAsync(() => api<{ max_cache_ttl_secs: number }>("GET", `/v1/admin/tenants/${tenant.id}/policy`), [tenant.id]);
  const choices = extendChoices(policy.data?.max_cache_ttl_secs);
  const [picked, setTtl] = useState("");
  const ttl = choices.some(([v]) => v === picked) ? picked : choices[0][0];
  if (list.error) return <ErrorBanner error={list.error} />;
  if (!list.data) return <Loading what="cache objects" />;
  const objects = list.data.data;
  return (
    <>
      <Table
        caption={`Cache objects${list.data.has_more ? " (the newest 100)" : ""}`}
        columns={["Object", "Workspace", "Model", "Tokens", "Created", "Expires", props.canEdit && "Actions"]}
        rows={objects} empty="No cache objects." row={(o) => (
          <tr key={o.id} data-object={o.id}>
            <th scope="row">
              {o.display_name ?? <em>unnamed</em>} <code>{o.id}</code>
            </th>
            <td>{o.workspace_name}</td>
            <td>{o.model}</td>
            <td>{formatTokens(o.input_tokens)}</td>
            <td>{formatTime(o.created_at)}</td>
            <td>{formatTime(o.expires_at)}</td>
            {props.canEdit && (
              <td>
                <button type="button" class="secondary" aria-label={`Extend ${o.id}`} onClick={() => setExtending(o)}>
                  Extend
                </button>{" "}
                <button type="button" class="danger" aria-label={`Delete ${o.id}`} onClick={() => setDeleting(o)}>
                  Delete
                </button>
              </td>
            )}
          </tr>
        )}
      />
      <Confirm
        open={extending !== null}
        title={`Extend ${extending?.display_name ?? extending?.id ?? ""}`}
        body={
          <label>
            Held until, from now
            <select value={ttl} onChange={(e) => setTtl((e.target as HTMLSelectElement).value)}>
              {choices.map(([v, label]) => (
                <option key={v} value={v}>
                  {label}
                </option>
              ))}
            </select>
            <small>Within the tenant's longest cache object lifetime (its policy). Storage is billed by the hour held.</small>
          </label>
        }
        action="Extend"
        onClose={() => setExtending(null)}
        onConfirm={async () => {
          const o = await api<CacheObject>("PATCH", `/v1/admin/tenants/${tenant.id}/cache/objects/${extending!.id}`, {
            ttl,
          });
          await list.reload();
          props.onChange(`Cache object ${o.id} now expires ${formatTime(o.expires_at)}.`);
        }}
      />
      <Confirm
        open={deleting !== null}
        title={`Delete ${deleting?.display_name ?? deleting?.id ?? ""}?`}
        body={<p>Requests naming {deleting?.id} get 404 from now on. This cannot be undone.</p>}
        action="Delete"
        danger
        onClose={() => setDeleting(null)}
        onConfirm={async () => {
          const d = await api<{ bytes_freed: number; bytes_held: number; nodes_pending: string[] }>(
            "DELETE",
            `/v1/admin/tenants/${tenant.id}/cache/objects/${deleting!.id}`,
          );
          // The notice comes with the list that no longer has it.
          await list.reload();
          props.onChange(`Cache object ${deleting!.id} deleted. ${releasedText(d)}`);
        }}
      />
    </>
  );
}
