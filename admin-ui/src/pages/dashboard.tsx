import { useMemo, useState } from "preact/hooks";
import { api, download, qs } from "../api";
import { TimeChart } from "../components/chart";
import { ErrorBanner, Kpi, Loading, message, Pick, Table, useAsync } from "../components/ui";
import { count, formatCost, formatMoney, formatMoneyAxis, formatRatio, formatTime, formatTokens, sumExact, writesNotHeld } from "../format";
import { dateRange } from "../forms";
import type { BudgetView, Tenant, UsagePoint, UsageView } from "../types";
import { useWorkspaces } from "./workspaces";

/** `tag:NAME` splits by the value of one tag of each key. */
type SplitBy = "model" | "api_key" | "workspace" | `tag:${string}`;

const SPLIT_CAPTION: Record<string, string> = { api_key: "By API key", workspace: "By workspace", tag: "By tag", model: "By model" };
const SPLIT_HEAD: Record<string, string> = { api_key: "Key", workspace: "Workspace", tag: "Tag value", model: "Model" };

const PRESETS: [string, string, number][] = [
  ["24h", "Last 24 hours", 1],
  ["7d", "Last 7 days", 7],
  ["30d", "Last 30 days", 30],
];

function rangeOf(preset: string, from: string, to: string): { from: string; to: string } | string {
  const p = PRESETS.find(([k]) => k === preset);
  if (p) {
    const end = new Date(Math.ceil(Date.now() / 3600_000) * 3600_000);
    return { from: new Date(end.getTime() - p[2] * 86400_000).toISOString(), to: end.toISOString() };
  }
  return dateRange(from, to);
}

export function DashboardTab({ tenant }: { tenant: Tenant }) {
  const [preset, setPreset] = useState("24h");
  const today = new Date().toISOString().slice(0, 10);
  const [from, setFrom] = useState(today);
  const [to, setTo] = useState(today);
  const [by, setBy] = useState<SplitBy>("model");
  const [workspace, setWorkspace] = useState("");
  const workspaces = useWorkspaces(tenant, true);
  const [stamp, setStamp] = useState(0);
  const range = rangeOf(preset, from, to);
  const usage = useAsync(async () => {
    if (typeof range === "string") throw new Error(range);
    const base = `/v1/admin/tenants/${tenant.id}/usage`;
    const [total, split] = await Promise.all([
      api<UsageView>("GET", `${base}${qs({ ...range, workspace })}`),
      api<UsageView>(
        "GET",
        `${base}${qs({ ...range, workspace, granularity: "day", ...(by.startsWith("tag:") ? { group_by: "tag", tag: by.slice(4) } : { group_by: by }) })}`,
      ),
    ]);
    return { total, split };
  }, [tenant.id, preset, from, to, by, workspace, stamp]);
  const budget = useAsync(() => api<BudgetView>("GET", `/v1/admin/tenants/${tenant.id}/budget`), [tenant.id, stamp]);
  const [exportError, setExportError] = useState<string | null>(null);
  const exportCsv = async () => {
    if (typeof range === "string") return setExportError(range);
    try {
      const day = (t: string) => t.slice(0, 10);
      await download(
        `/v1/billing/exports/usage${qs({ ...range, tenant: tenant.id, workspace, format: "csv" })}`,
        `cachet-usage-${tenant.name}-${day(range.from)}-${day(range.to)}.csv`,
      );
      setExportError(null);
    } catch (e) {
      setExportError(message(e));
    }
  };
  return (
    <section aria-labelledby="dash-title">
      <h2 id="dash-title">Usage</h2>
      <form class="row" aria-label="Time range" onSubmit={(e) => e.preventDefault()}>
        <label for="range">
          Range
          <select id="range" value={preset} onChange={(e) => setPreset(e.currentTarget.value)}>
            {PRESETS.map(([k, label]) => (
              <option key={k} value={k}>
                {label}
              </option>
            ))}
            <option value="custom">Dates…</option>
          </select>
        </label>
        {preset === "custom" && (
          <>
            <label for="from">
              From
              <input id="from" type="date" value={from} onChange={(e) => setFrom(e.currentTarget.value)} />
            </label>
            <label for="to">
              To (inclusive)
              <input id="to" type="date" value={to} onChange={(e) => setTo(e.currentTarget.value)} />
            </label>
          </>
        )}
        {(workspaces.data?.data.length ?? 0) > 1 && (
          <Pick id="dash-workspace" label="Workspace" value={workspace} none="All workspaces" items={workspaces.data?.data ?? []} onChange={setWorkspace} />
        )}
        <button type="button" class="secondary" onClick={() => setStamp((s) => s + 1)}>
          Refresh
        </button>
        <button type="button" class="secondary" onClick={exportCsv}>
          Export ledger rows (CSV)
        </button>
      </form>
      <ErrorBanner error={exportError} />
      <ErrorBanner error={usage.error} />
      {usage.loading && !usage.data && <Loading what="usage" />}
      {budget.data && <BudgetBanner b={budget.data} />}
      {usage.data && <Usage view={usage.data.total} />}
      {budget.data && <Budget b={budget.data} />}
      <ErrorBanner error={budget.error} />
      {usage.data && (
        <>
          <label for="split">
            Split by
            <select id="split" value={by} onChange={(e) => setBy(e.currentTarget.value as SplitBy)}>
              <option value="model">Model</option>
              <option value="api_key">API key</option>
              <option value="workspace">Workspace</option>
              {(usage.data.total.tag_names ?? []).map((t) => (
                <option key={t} value={`tag:${t}`}>
                  Tag: {t}
                </option>
              ))}
            </select>
          </label>
          <Split view={usage.data.split} />
        </>
      )}
    </section>
  );
}

const ratioOf = (p: UsagePoint): number | null => (p.requests > 0 ? p.hit_ratio : null);

function Usage({ view }: { view: UsageView }) {
  const t = view.totals;
  const cur = view.currency;
  const charts = useMemo(() => {
    // Every bucket of the window, empty ones too (the API leaves them out).
    const step = view.granularity === "hour" ? 3600_000 : 86400_000;
    const start = Math.floor(new Date(view.from).getTime() / step) * step;
    const byTime = new Map(view.series.map((p) => [new Date(p.bucket_start!).getTime(), p]));
    const buckets: number[] = [];
    for (let t = start; t < new Date(view.to).getTime(); t += step) buckets.push(t);
    const times = buckets.map((t) => new Date(t).toISOString());
    const pick = (f: (p: UsagePoint) => number | null) =>
      buckets.map((t) => {
        const p = byTime.get(t);
        return p ? f(p) : f === ratioOf ? null : 0;
      });
    return {
      times,
      requests: [{ label: "Requests", values: pick((p) => p.requests), color: "#1e6fd9", fill: true }],
      tokens: [
        { label: "Input (uncached)", values: pick((p) => p.input_tokens), color: "#6b7280" },
        { label: "Cache write 5m", values: pick((p) => p.cache_write_5m_tokens), color: "#d97706" },
        { label: "Cache write 1h", values: pick((p) => p.cache_write_1h_tokens), color: "#b91c1c" },
        { label: "Cache read", values: pick((p) => p.cache_read_tokens), color: "#059669" },
        { label: "Output", values: pick((p) => p.output_tokens), color: "#7c3aed" },
      ],
      ratio: [{ label: "Hit ratio", values: pick(ratioOf), color: "#059669", fill: true }],
      saved: [
        { label: "Cost", values: pick((p) => p.cost_minor), color: "#1e6fd9" },
        { label: "Saved by caching", values: pick((p) => p.saved_minor), color: "#059669", fill: true },
      ],
    };
  }, [view]);
  // The time axis every chart shares.
  const axis = { window: [view.from, view.to] as [string, string], times: charts.times };
  const prompt = t.input_tokens + t.cache_write_5m_tokens + t.cache_write_1h_tokens + t.cache_read_tokens;
  return (
    <>
      <div class="kpis">
        <Kpi label="Requests" value={t.requests.toLocaleString("en-US")} />
        <Kpi label="Prompt tokens" value={formatTokens(prompt)} note={`${formatTokens(t.output_tokens)} output`} />
        <Kpi label="Hit ratio" value={formatRatio(t.hit_ratio)} note="prompt tokens read from the cache" />
        <Kpi label="Cost" value={formatCost(t.cost_minor, t.cost, cur)}
          note={`${formatCost(t.cost_without_cache_minor, t.cost_without_cache, cur)} without caching`} />
        <Kpi label="Saved by caching" value={formatCost(t.saved_minor, t.saved, cur)} note="net of the cache-write premium" />
        {t.cache_storage_token_seconds > 0 && (
          <Kpi
            label="Cache objects held"
            value={`${formatTokens(Math.round(t.cache_storage_token_seconds / 36) / 100)} token-h`}
            note="billed by the hour, in Cost"
          />
        )}
      </div>
      {writesNotHeld(view.cache_writes_not_held) && (
        <p role="note" data-not-held>
          {writesNotHeld(view.cache_writes_not_held)}
        </p>
      )}
      {t.unpriced_tokens > 0 && (
        <p role="note">
          {formatTokens(t.unpriced_tokens)} tokens had no price in force and are counted at zero: add a price for their model.
        </p>
      )}
      {view.series.length === 0 ? (
        <p>No requests in this range yet (usage appears within a minute of a request).</p>
      ) : (
        <div class="charts">
          <TimeChart {...axis} title="Requests" series={charts.requests} format={formatTokens}
            summary={`${count(t.requests, "request")} in ${count(view.series.length, view.granularity)}`} />
          <TimeChart {...axis} title="Tokens by class" series={charts.tokens} format={formatTokens}
            summary={`input ${t.input_tokens}, 5m writes ${t.cache_write_5m_tokens}, 1h writes ${t.cache_write_1h_tokens}, reads ${t.cache_read_tokens}, output ${t.output_tokens}`} />
          <TimeChart {...axis} title="Hit ratio" series={charts.ratio} format={formatRatio} range={[0, 1]}
            summary={`${formatRatio(t.hit_ratio)} over the range`} />
          <TimeChart {...axis} title="Cost and savings" series={charts.saved} format={(v) => formatMoneyAxis(v, cur)}
            summary={`cost ${formatCost(t.cost_minor, t.cost, cur)}, saved ${formatCost(t.saved_minor, t.saved, cur)}`} />
        </div>
      )}
    </>
  );
}

/** Said at the top of the dashboard once spend passes the alert threshold or the budget. */
function BudgetBanner({ b }: { b: BudgetView }) {
  if (b.limit_minor === null || (b.state !== "alert" && b.state !== "exhausted")) return null;
  const spent = `${formatMoney(b.spent_minor, b.currency)} of ${formatMoney(b.limit_minor, b.currency)}`;
  return b.state === "exhausted" ? (
    <p class="error-banner" role="alert" data-budget-banner="exhausted">
      Monthly budget reached: {spent} spent. Requests are refused (429) until it resets {formatTime(b.resets_at)} or the budget is
      raised.
    </p>
  ) : (
    <p class="warning" role="alert" data-budget-banner="alert">
      Budget alert: {spent} spent this month, past the {b.alert_percent}% threshold. Requests are refused once the budget is
      reached; it resets {formatTime(b.resets_at)}.
    </p>
  );
}

function Budget({ b }: { b: BudgetView }) {
  // A budget of zero is spent from the start.
  const pct = b.limit_minor === null ? 0 : b.limit_minor <= 0 ? 1 : Math.min(1, b.spent_minor / b.limit_minor);
  return (
    <article aria-labelledby="budget-title">
      <h3 id="budget-title">Budget this month</h3>
      <p>
        Spent <strong>{formatMoney(b.spent_minor, b.currency)}</strong>
        {b.limit_minor !== null ? (
          <>
            {" "}
            of {formatMoney(b.limit_minor, b.currency)} (<span class={`state-${b.state}`}>{b.state}</span>, alert at{" "}
            {b.alert_percent}%)
          </>
        ) : (
          " (no budget set)"
        )}
        ; resets {formatTime(b.resets_at)}.
      </p>
      {b.limit_minor !== null && (
        <div class={`bar state-${b.state}`} role="progressbar" aria-label="Budget spent" aria-valuemin={0} aria-valuemax={100} aria-valuenow={Math.round(pct * 100)}>
          <span style={{ width: `${pct * 100}%` }} />
        </div>
      )}
      {b.refusals.length > 0 ? (
        <Table caption="Requests refused this month, by limit" columns={["Limit", "Refused"]}>
          <tbody>
            {b.refusals.map((r) => (
              <tr key={r.limit}>
                <td>{r.limit.replace(/_/g, " ")}</td>
                <td data-refusals={r.limit}>{r.count}</td>
              </tr>
            ))}
          </tbody>
        </Table>
      ) : (
        <p>No request was refused this month.</p>
      )}
    </article>
  );
}

function Split({ view }: { view: UsageView }) {
  const rows = useMemo(() => {
    const m = new Map<string, UsagePoint[]>();
    for (const p of view.series) {
      const k =
        view.group_by === "api_key"
          ? (p.api_key ?? "")
          : view.group_by === "workspace"
            ? (p.workspace ?? "")
            : view.group_by === "tag"
              ? (p.tag ?? "")
              : (p.model ?? "");
      m.set(k, [...(m.get(k) ?? []), p]);
    }
    return [...m.entries()].map(([k, ps]) => {
      const sum = (f: (p: UsagePoint) => number) => ps.reduce((a, p) => a + f(p), 0);
      const read = sum((p) => p.cache_read_tokens);
      const prompt = read + sum((p) => p.input_tokens + p.cache_write_5m_tokens + p.cache_write_1h_tokens);
      return {
        name:
          view.group_by === "api_key"
            ? (view.key_names[k] ?? k)
            : view.group_by === "workspace"
              ? (view.workspace_names[k] ?? k)
              : view.group_by === "tag" && k === ""
                ? "(untagged)"
                : k,
        requests: sum((p) => p.requests),
        input: sum((p) => p.input_tokens),
        w5: sum((p) => p.cache_write_5m_tokens),
        w1: sum((p) => p.cache_write_1h_tokens),
        read,
        output: sum((p) => p.output_tokens),
        ratio: prompt ? read / prompt : 0,
        // Exact, then rounded once: a sum of buckets rounded each to the cent would read $0.00.
        cost: sumExact(
          ps.map((p) => p.cost),
          view.currency,
        ),
        saved: sumExact(
          ps.map((p) => p.saved),
          view.currency,
        ),
      };
    });
  }, [view]);
  return (
    <Table caption={SPLIT_CAPTION[view.group_by] ?? "By model"}>
      <thead>
        <tr>
          <th scope="col">{SPLIT_HEAD[view.group_by] ?? "Model"}</th>
          <th scope="col">Requests</th>
          <th scope="col">Input</th>
          <th scope="col">Write 5m</th>
          <th scope="col">Write 1h</th>
          <th scope="col">Read</th>
          <th scope="col">Output</th>
          <th scope="col">Hit ratio</th>
          <th scope="col">Cost</th>
          <th scope="col">Saved</th>
        </tr>
      </thead>
      <tbody>
        {rows.map((r) => (
          <tr key={r.name}>
            <th scope="row">{r.name}</th>
            <td>{r.requests}</td>
            <td>{formatTokens(r.input)}</td>
            <td>{formatTokens(r.w5)}</td>
            <td>{formatTokens(r.w1)}</td>
            <td>{formatTokens(r.read)}</td>
            <td>{formatTokens(r.output)}</td>
            <td>{formatRatio(r.ratio)}</td>
            <td>{formatCost(r.cost.minor, r.cost.exact, view.currency)}</td>
            <td>{formatCost(r.saved.minor, r.saved.exact, view.currency)}</td>
          </tr>
        ))}
      </tbody>
    </Table>
  );
}
