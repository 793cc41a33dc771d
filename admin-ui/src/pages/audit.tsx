import { useState } from "preact/hooks";
import { api, download, qs, type Me } from "../api";
import { ErrorBanner, Loading, Table, useAction, useAsync } from "../components/ui";
import { formatTime } from "../format";
import type { AuditRow, Tenant } from "../types";

function summary(v: unknown): string {
  if (v === null || v === undefined) return "";
  const s = JSON.stringify(v);
  return s.length > 160 ? `${s.slice(0, 157)}…` : s;
}

/** A long id shown short (its full form in the cell's title). */
function shortId(id: string): string {
  return id.length > 13 ? `${id.slice(0, 8)}…` : id;
}

/** The audit log: every tenant's for a platform admin, one tenant's on its page. */
export function AuditPage({ me, tenant }: { me: Me; tenant: Tenant | null }) {
  const [action, setAction] = useState("");
  const [pages, setPages] = useState<(number | null)[]>([null]);
  const { error, run } = useAction();
  const before = pages[pages.length - 1];
  const scope = tenant?.id ?? (me.role === "tenant_admin" ? me.tenant : null);
  const log = useAsync(
    () =>
      api<{ data: AuditRow[]; next_before_id: number | null }>(
        "GET",
        `/v1/admin/audit${qs({ tenant: scope, action: action.trim(), before_id: before, limit: 50 })}`,
      ),
    [scope, action, before],
  );
  const exportAs = (format: "csv" | "jsonl") =>
    run(() => download(`/v1/admin/audit/export${qs({ tenant: scope, action: action.trim(), format })}`, `cachet-audit.${format}`));
  return (
    <section aria-labelledby="audit-title">
      <h2 id="audit-title">Audit log</h2>
      <div class="row">
        <label for="audit-action">
          Action starts with
          <input
            id="audit-action"
            placeholder="key., policy.update, tenant."
            value={action}
            onChange={(e) => {
              setAction(e.currentTarget.value);
              setPages([null]);
            }}
          />
        </label>
        <div class="actions">
          <button type="button" class="secondary" onClick={() => exportAs("csv")}>
            Export CSV
          </button>
          <button type="button" class="secondary" onClick={() => exportAs("jsonl")}>
            Export JSON Lines
          </button>
        </div>
      </div>
      <ErrorBanner error={error ?? log.error} />
      {log.loading && !log.data ? (
        <Loading what="the audit log" />
      ) : (
        <div class="audit-log">
          <Table caption="Changes, newest first">
            <thead>
              <tr>
                <th scope="col" class="when">
                  When
                </th>
                <th scope="col">Who</th>
                <th scope="col" class="action">
                  Action
                </th>
                {!scope && <th scope="col">Tenant</th>}
                <th scope="col">Object</th>
                <th scope="col" class="change">
                  Change
                </th>
              </tr>
            </thead>
            <tbody>
              {log.data?.data.map((r) => (
                <tr key={r.id}>
                  <td class="when">{formatTime(r.at)}</td>
                  <td>{r.actor}</td>
                  <td class="action">
                    <code>{r.action}</code>
                  </td>
                  {!scope && <td>{r.tenant_name ?? (r.tenant_id ? shortId(r.tenant_id) : "–")}</td>}
                  <td title={r.target ?? undefined}>{r.target_name ?? (r.target ? shortId(r.target) : "–")}</td>
                  <td class="change">
                    {r.before !== null && r.before !== undefined && (
                      <div>
                        <small>before</small> <code class="hash">{summary(r.before)}</code>
                      </div>
                    )}
                    {r.after !== null && r.after !== undefined && (
                      <div>
                        <small>after</small> <code class="hash">{summary(r.after)}</code>
                      </div>
                    )}
                  </td>
                </tr>
              ))}
            </tbody>
          </Table>
        </div>
      )}
      <div class="actions">
        <button type="button" class="secondary" disabled={pages.length < 2} onClick={() => setPages(pages.slice(0, -1))}>
          Newer
        </button>
        <button
          type="button"
          class="secondary"
          disabled={!log.data?.next_before_id}
          onClick={() => setPages([...pages, log.data!.next_before_id])}
        >
          Older
        </button>
      </div>
    </section>
  );
}
