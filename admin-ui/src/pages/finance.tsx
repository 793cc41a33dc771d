import { useState } from "preact/hooks";
import { api, download, qs, type Me } from "../api";
import { Confirm, ErrorBanner, Loaded, Loading, message, Notice, Pick, Table, useAction, useAsync } from "../components/ui";
import { count, formatMoney, formatTime, formatTokens } from "../format";
import { dateRange, exportFileName } from "../forms";
import type { Invoice, InvoiceSummary, Key, Tenant, Tokens, Workspace } from "../types";

function useTenants() {
  return useAsync(() => api<{ data: Tenant[] }>("GET", "/v1/admin/tenants?include_deleted=true"), []);
}

export function FinancePage({ me }: { me: Me }) {
  const tenants = useTenants();
  const [tenant, setTenant] = useState("");
  const invoices = useAsync(
    () => api<{ data: InvoiceSummary[] }>("GET", `/v1/billing/invoices${qs({ tenant })}`),
    [tenant],
  );
  const name = (id: string) => tenants.data?.data.find((t) => t.id === id)?.name ?? id;
  const canRate = me.role === "platform_admin" || me.role === "finance";
  return (
    <section>
      <h1>Finance</h1>
      <p>
        <a href="#/finance/prices">Price book</a>
      </p>
      <Pick id="inv-tenant" label="Tenant" value={tenant} none="All tenants" items={tenants.data?.data ?? []} onChange={setTenant} />
      {canRate && tenants.data && <RateMonth tenants={tenants.data.data} onRated={() => invoices.reload()} />}
      <Loaded state={invoices} what="invoices">
        <Table caption="Invoices, newest month first" columns={["Month", "Tenant", "Status", "Total"]}>
          <tbody>
            {invoices.data?.data.length === 0 && (
              <tr>
                <td colSpan={4}>No invoice yet: rate a month above.</td>
              </tr>
            )}
            {invoices.data?.data.map((i) => (
              <tr key={i.id}>
                <td>
                  <a href={`#/finance/invoices/${i.id}`}>{i.period_start.slice(0, 7)}</a>
                </td>
                <td>{name(i.tenant_id)}</td>
                <td>{i.status}</td>
                <td>{formatMoney(i.total_minor, i.currency)}</td>
              </tr>
            ))}
          </tbody>
        </Table>
      </Loaded>
      {canRate && <MonthOverview />}
      {canRate && <Exports tenant={tenant} tenantName={tenant ? name(tenant) : ""} />}
    </section>
  );
}

function RateMonth({ tenants, onRated }: { tenants: Tenant[]; onRated: () => void }) {
  const [tenant, setTenant] = useState("");
  const [month, setMonth] = useState(new Date().toISOString().slice(0, 7));
  const [notice, setNotice] = useState<string | null>(null);
  const { busy, error, setError, run } = useAction();
  return (
    <form
      class="row"
      aria-label="Rate a month"
      onSubmit={async (e) => {
        e.preventDefault();
        if (!tenant) {
          setError("Choose a tenant to rate.");
          return;
        }
        if (!/^\d{4}-\d{2}$/.test(month)) {
          setError("Choose a month.");
          return;
        }
        await run(async () => {
          const inv = await api<Invoice>("POST", "/v1/billing/invoices", { tenant, month });
          setNotice(`Draft for ${month}: ${formatMoney(inv.total_minor, inv.currency)}.`);
          onRated();
        });
      }}
    >
      <Pick
        id="rate-tenant"
        label="Rate the draft of"
        value={tenant}
        none="Choose a tenant…"
        items={tenants.filter((t) => t.state !== "deleted")}
        onChange={setTenant}
      />
      <label for="rate-month">
        Month
        <input id="rate-month" type="month" value={month} onChange={(e) => setMonth(e.currentTarget.value)} />
      </label>
      <button type="submit" aria-busy={busy} disabled={busy}>
        Rate draft
      </button>
      <ErrorBanner error={error} />
      <Notice text={notice} />
    </form>
  );
}

interface TenantMonth extends Tokens {
  tenant: string;
  name: string;
  state: string;
  hit_ratio: number;
  currency: string;
  cost_minor: number;
  saved_minor: number;
  unpriced_tokens: number;
  budget_minor: number | null;
  budget_state: "none" | "ok" | "alert" | "exhausted";
}

interface Overview {
  month: string;
  data: TenantMonth[];
  totals: { currency: string; tenants: number; requests: number; cost_minor: number; saved_minor: number }[];
}

/** A month across tenants: what each spent and saved, and where its budget stands. */
function MonthOverview() {
  const [month, setMonth] = useState(new Date().toISOString().slice(0, 7));
  const [error, setError] = useState<string | null>(null);
  const o = useAsync(() => api<Overview>("GET", `/v1/admin/overview${qs({ month })}`), [month]);
  return (
    <section aria-labelledby="overview-title">
      <h2 id="overview-title">Month overview</h2>
      <div class="row">
        <label for="ov-month">
          Month
          <input id="ov-month" type="month" value={month} onChange={(e) => e.currentTarget.value && setMonth(e.currentTarget.value)} />
        </label>
        <div class="actions">
          <button
            type="button"
            onClick={async () => {
              try {
                await download(`/v1/admin/overview${qs({ month, format: "csv" })}`, `cachet-${month}.csv`);
                setError(null);
              } catch (e) {
                setError(message(e));
              }
            }}
          >
            Download overview CSV
          </button>
        </div>
      </div>
      <ErrorBanner error={error ?? o.error} />
      {o.loading && !o.data ? (
        <Loading what="the month" />
      ) : (
        <Table caption={`Tenants in ${month}`}>
          <thead>
            <tr>
              <th scope="col">Tenant</th>
              <th scope="col">Requests</th>
              <th scope="col">Input</th>
              <th scope="col">Cache writes</th>
              <th scope="col">Cache reads</th>
              <th scope="col">Output</th>
              <th scope="col">Cost</th>
              <th scope="col">Saved</th>
              <th scope="col" title="cache objects held, in token-hours (their cost is in Cost)">Objects held</th>
              <th scope="col">Budget</th>
            </tr>
          </thead>
          <tbody>
            {o.data?.data.length === 0 && (
              <tr>
                <td colSpan={10}>No usage this month.</td>
              </tr>
            )}
            {o.data?.data.map((r) => (
              <tr key={r.tenant} data-budget={r.budget_state}>
                <td>
                  {r.name}
                  {r.state !== "active" ? ` (${r.state})` : ""}
                </td>
                <td>{r.requests.toLocaleString("en-US")}</td>
                <td>{r.input_tokens.toLocaleString("en-US")}</td>
                <td>{(r.cache_write_5m_tokens + r.cache_write_1h_tokens).toLocaleString("en-US")}</td>
                <td>{r.cache_read_tokens.toLocaleString("en-US")}</td>
                <td>{r.output_tokens.toLocaleString("en-US")}</td>
                <td>{formatMoney(r.cost_minor, r.currency)}</td>
                <td>{formatMoney(r.saved_minor, r.currency)}</td>
                <td>{r.cache_storage_token_seconds > 0 ? `${formatTokens(Math.round(r.cache_storage_token_seconds / 36) / 100)} token-h` : "–"}</td>
                <td class={`budget-${r.budget_state}`}>
                  {r.budget_minor === null ? "–" : `${formatMoney(r.budget_minor, r.currency)} · ${r.budget_state}`}
                </td>
              </tr>
            ))}
          </tbody>
          <tfoot>
            {o.data?.totals.map((t) => (
              <tr key={t.currency}>
                <th scope="row">
                  Total, {count(t.tenants, "tenant")}
                </th>
                <td>{t.requests.toLocaleString("en-US")}</td>
                <td colSpan={4} />
                <td data-total={t.currency}>{formatMoney(t.cost_minor, t.currency)}</td>
                <td>{formatMoney(t.saved_minor, t.currency)}</td>
                <td colSpan={2} />
              </tr>
            ))}
          </tfoot>
        </Table>
      )}
    </section>
  );
}

function Exports({ tenant, tenantName }: { tenant: string; tenantName: string }) {
  const today = new Date().toISOString().slice(0, 10);
  const first = `${today.slice(0, 8)}01`;
  const [from, setFrom] = useState(first);
  const [to, setTo] = useState(today);
  const [model, setModel] = useState("");
  const [workspace, setWorkspace] = useState("");
  const [key, setKey] = useState("");
  const [ledger, setLedger] = useState<"usage" | "storage">("usage");
  const workspaces = useAsync(
    () =>
      tenant
        ? api<{ data: Workspace[] }>("GET", `/v1/admin/tenants/${tenant}/workspaces?include_archived=true`)
        : Promise.resolve({ data: [] as Workspace[] }),
    [tenant],
  );
  // Keys by name (finance may read them, never their secrets), those of the chosen workspace.
  const keys = useAsync(
    () => (tenant ? api<{ data: Key[] }>("GET", `/v1/admin/tenants/${tenant}/keys`) : Promise.resolve({ data: [] as Key[] })),
    [tenant],
  );
  const keyItems = (keys.data?.data ?? []).filter((k) => !workspace || k.workspace_id === workspace);
  const named = <T extends { id: string; name: string }>(items: T[] | undefined, id: string) =>
    items?.find((i) => i.id === id)?.name ?? "";
  const { error, setError, run } = useAction();
  // `focus`: every charge (both ledgers) as a FinOps FOCUS 1.2 dataset, a CSV of its own.
  const get = async (format: "csv" | "jsonl" | "cloudevents" | "focus") => {
    const r = dateRange(from, to);
    if (typeof r === "string") {
      setError(r);
      return;
    }
    const ws = tenant && (workspaces.data?.data ?? []).some((w) => w.id === workspace) ? workspace : "";
    const k = tenant && keyItems.some((i) => i.id === key) ? key : "";
    const filter = { tenant, model: model.trim(), workspace: ws, api_key: k };
    const focus = format === "focus";
    const file = exportFileName({
      ledger: focus ? "focus" : ledger,
      tenant: tenantName,
      workspace: named(workspaces.data?.data, ws),
      key: named(keys.data?.data, k),
      model: model.trim(),
      from,
      to,
      format: focus ? "csv" : format,
    });
    const url = focus ? `/v1/billing/exports/focus${qs({ ...r, ...filter })}` : `/v1/billing/exports/${ledger}${qs({ ...r, ...filter, format })}`;
    await run(() => download(url, file));
  };
  return (
    <section aria-labelledby="exports-title">
      <h2 id="exports-title">Usage exports</h2>
      <p>
        Every ledger row in the range ({tenant ? "the chosen tenant" : "all tenants"}), streamed, with the names of its tenant,
        workspace and key and its exact cost: one row per request, or one per cache object and hour it was held.
      </p>
      <div class="row">
        <label for="exp-ledger">
          Ledger
          <select id="exp-ledger" value={ledger} onChange={(e) => setLedger(e.currentTarget.value as "usage" | "storage")}>
            <option value="usage">requests (usage)</option>
            <option value="storage">cache objects held (storage)</option>
          </select>
        </label>
        <label for="exp-from">
          From
          <input id="exp-from" type="date" value={from} onChange={(e) => setFrom(e.currentTarget.value)} />
        </label>
        <label for="exp-to">
          To (inclusive)
          <input id="exp-to" type="date" value={to} onChange={(e) => setTo(e.currentTarget.value)} />
        </label>
        <label for="exp-model">
          Model (optional)
          <input id="exp-model" value={model} placeholder="every model" onInput={(e) => setModel(e.currentTarget.value)} />
        </label>
        {tenant && (
          <Pick id="exp-workspace" label="Workspace" value={workspace} none="every workspace" items={workspaces.data?.data ?? []}
            onChange={(w) => {
              setWorkspace(w);
              setKey("");
            }} />
        )}
        {tenant && <Pick id="exp-key" label="API key" value={key} none="every key" items={keyItems} onChange={setKey} />}
        <div class="actions">
          <button type="button" onClick={() => get("csv")}>
            Download CSV
          </button>
          <button type="button" class="secondary" onClick={() => get("jsonl")}>
            JSON Lines
          </button>
          <button type="button" class="secondary" onClick={() => get("cloudevents")}>
            CloudEvents
          </button>
          <button type="button" class="secondary" onClick={() => get("focus")} title="Every charge of both ledgers, hourly per key, model and SKU, for cloud cost tools">
            FOCUS 1.2
          </button>
        </div>
      </div>
      <ErrorBanner error={error} />
    </section>
  );
}

export function InvoicePage({ me, id }: { me: Me; id: string }) {
  const inv = useAsync(() => api<Invoice>("GET", `/v1/billing/invoices/${id}`), [id]);
  const tenants = useTenants();
  const [confirming, setConfirming] = useState(false);
  const [rating, setRating] = useState(false);
  const [actionError, setActionError] = useState<string | null>(null);
  const downloadAs = async (format: "csv" | "pdf") => {
    try {
      await download(`/v1/billing/invoices/${i.id}?format=${format}`, `cachet-invoice-${month}-${tenantName}.${format}`);
      setActionError(null);
    } catch (e) {
      setActionError(message(e));
    }
  };
  if (inv.error) return <ErrorBanner error={inv.error} />;
  if (!inv.data) return <Loading what="the invoice" />;
  const i = inv.data;
  const month = i.period_start.slice(0, 7);
  // A month can be finalized once it is over: from the first day of the next (UTC).
  const [year, monthNumber] = month.split("-").map(Number);
  const finalizableFrom = new Date(Date.UTC(year, monthNumber, 1));
  const monthOpen = Date.now() < finalizableFrom.getTime();
  const tenantName = tenants.data?.data.find((t) => t.id === i.tenant_id)?.name ?? i.tenant_id;
  return (
    <section>
      <p>
        <a href="#/finance">← Invoices</a>
      </p>
      <hgroup>
        <h1>
          Invoice {month} · {tenantName}
        </h1>
        <p>
          {i.status}
          {i.finalized_at ? ` on ${formatTime(i.finalized_at)}` : ""} · total {formatMoney(i.total_minor, i.currency)} · rated{" "}
          {formatTime(i.rated_at)}
        </p>
      </hgroup>
      <Notice text={i.status === "finalized" ? "Finalized: this invoice can no longer change; corrections are adjustments." : null} />
      {i.unpriced.length > 0 && (
        <p class="warning" role="alert" data-unpriced>
          Usage of {i.unpriced.join(", ")} had no price in force: it is listed at zero and not billed. Add a price for{" "}
          {i.unpriced.length > 1 ? "these models" : "this model"} (dated back to the usage) and rate the draft again; a draft with
          unpriced usage cannot be finalized.
        </p>
      )}
      {/* Amounts as the PDF and the CSV write them (the server's one rule): exact lines, the
          rounding row, the total; the column adds up to the total. */}
      <Table caption="Lines" columns={["Description", "Quantity", `Amount (${i.currency})`]}>
        <tbody>
          {i.lines.map((l, n) => (
            <tr key={n} data-line>
              <td>{l.description}</td>
              <td>{l.quantity.toLocaleString("en-US")}</td>
              <td class="amount">{l.amount}</td>
            </tr>
          ))}
          <tr data-rounding>
            <td>{i.rounding.description}</td>
            <td />
            <td class="amount">{i.rounding.amount}</td>
          </tr>
        </tbody>
        <tfoot>
          <tr>
            <th scope="row" colSpan={2}>
              Total (the lines' exact sum, rounded once)
            </th>
            <td>{formatMoney(i.total_minor, i.currency)}</td>
          </tr>
        </tfoot>
      </Table>
      <ErrorBanner error={actionError} />
      <div class="actions">
        <button
          type="button"
          class="secondary"
          onClick={() => downloadAs("csv")}
        >
          Download invoice CSV
        </button>
        <button
          type="button"
          onClick={() => downloadAs("pdf")}
        >
          Download invoice PDF
        </button>
        {i.status === "draft" && me.role !== "tenant_admin" && (
          <>
            <button
              type="button"
              class="secondary"
              aria-busy={rating}
              disabled={rating}
              onClick={async () => {
                setRating(true);
                try {
                  inv.setData(await api<Invoice>("POST", "/v1/billing/invoices", { tenant: i.tenant_id, month }));
                  setActionError(null);
                } catch (e) {
                  setActionError(message(e));
                } finally {
                  setRating(false);
                }
              }}
            >
              Rate again
            </button>
            <button
              type="button"
              disabled={monthOpen}
              aria-describedby={monthOpen ? "finalize-when" : undefined}
              onClick={() => setConfirming(true)}
            >
              Finalize…
            </button>
          </>
        )}
      </div>
      {i.status === "draft" && me.role !== "tenant_admin" && monthOpen && (
        <small id="finalize-when">
          {month} is not over: it can be finalized from {finalizableFrom.toISOString().slice(0, 10)} (UTC).
        </small>
      )}
      <Confirm
        open={confirming}
        title={`Finalize the ${month} invoice of ${tenantName}?`}
        body={<p>It is rated one last time and then can never change. Only a month that is over can be finalized.</p>}
        action="Finalize"
        danger
        onClose={() => setConfirming(false)}
        onConfirm={async () => {
          inv.setData(await api<Invoice>("POST", "/v1/billing/invoices", { tenant: i.tenant_id, month, finalize: true }));
        }}
      />
    </section>
  );
}
