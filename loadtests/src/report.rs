//! The self-contained HTML reports: the summary's numbers embedded as JSON and drawn with
//! uPlot (inlined from `assets/`, MIT), so a report is one file that opens anywhere, offline.
//!
//! Every plot is a `<div class="plot" data-plot="…">` that gets `data-rendered` once drawn;
//! the screenshot test counts them.

use serde_json::Value;

const UPLOT_JS: &str = include_str!("../assets/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/uPlot.min.css");

/// Names of the replay report's plots, in page order.
pub const REPLAY_PLOTS: [&str; 10] = [
    "ttft-cdf",
    "tbt-cdf",
    "ttft-time",
    "throughput",
    "hit-ratio",
    "nodes",
    "tokens",
    "tenants",
    "cost",
    "errors",
];

/// Names of the sweep report's plots.
pub const SWEEP_PLOTS: [&str; 2] = ["capacity-ttft", "capacity-tbt"];

/// JSON inside a `<script>` element: `<` escaped so no string can close the element.
fn embed(v: &Value) -> String {
    v.to_string().replace('<', "\\u003c")
}

fn page(title: &str, data: &Value, body: &str, script: &str) -> String {
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<style>{UPLOT_CSS}
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1180px; color: #1d2433; }}
h1 {{ font-size: 22px; margin-bottom: 4px; }} h2 {{ font-size: 16px; margin: 4px 0 8px; }}
.sub {{ color: #5b6577; margin-bottom: 16px; }}
.cards {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 10px; margin: 12px 0 20px; }}
.card {{ border: 1px solid #d9dee8; border-radius: 8px; padding: 10px 12px; }}
.card b {{ display: block; font-size: 20px; }} .card span {{ color: #5b6577; font-size: 12px; }}
.grid {{ display: grid; grid-template-columns: 1fr 1fr; gap: 18px; }}
.panel {{ border: 1px solid #d9dee8; border-radius: 8px; padding: 12px; }}
table {{ border-collapse: collapse; width: 100%; margin: 8px 0 18px; }}
td, th {{ border-bottom: 1px solid #e6e9f0; padding: 4px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
.bad {{ color: #b3261e; font-weight: 600; }} .good {{ color: #1b7a3d; font-weight: 600; }}
</style></head>
<body>
{body}
<script>{UPLOT_JS}</script>
<script id="data" type="application/json">{data}</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent);
const W = () => Math.min(540, document.body.clientWidth / 2 - 40);
function plot(name, opts, data) {{
  const el = document.querySelector('[data-plot="' + name + '"]');
  opts.width = W(); opts.height = 260;
  new uPlot(opts, data, el);
  el.dataset.rendered = '1';
}}
// Marks (a fault's moment, …) as labelled vertical lines on a plot over time (x in seconds).
function marked(opts) {{
  const ms = D.marks || [];
  if (!ms.length) return opts;
  opts.hooks = {{ draw: [u => {{
    const c = u.ctx;
    c.save();
    c.strokeStyle = '#b3261e'; c.fillStyle = '#b3261e'; c.setLineDash([5, 4]); c.lineWidth = 1.5;
    c.font = (11 * devicePixelRatio) + 'px system-ui';
    ms.forEach(m => {{
      const x = u.valToPos(m.at_secs, 'x', true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
      c.beginPath(); c.moveTo(x, u.bbox.top); c.lineTo(x, u.bbox.top + u.bbox.height); c.stroke();
      c.fillText(m.label, x + 4, u.bbox.top + 12 * devicePixelRatio);
    }});
    c.restore();
  }}] }};
  return opts;
}}
function bars(name, labels, values, label, fmt) {{
  const xs = labels.map((_, i) => i);
  plot(name, {{
    scales: {{ x: {{ time: false, range: [-0.6, labels.length - 0.4] }}, y: {{ range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] }} }},
    axes: [{{ values: (u, v) => v.map(i => labels[i] ?? '') , splits: () => xs }}, {{ values: (u, v) => v.map(fmt) }}],
    series: [{{}}, {{ label, fill: '#4f7cd999', stroke: '#2f5cb9', paths: uPlot.paths.bars({{ size: [0.6, 90] }}), points: {{ show: false }} }}],
    legend: {{ show: false }},
  }}, [xs, values]);
}}
function cdf(name, lat, label) {{
  const pts = (lat && lat.cdf) || [];
  plot(name, {{
    scales: {{ x: {{ time: false }} }},
    series: [{{ label: 'ms' }}, {{ label, stroke: '#2f5cb9', width: 2 }}],
    axes: [{{ label: 'ms' }}, {{ label: 'fraction of requests' }}],
  }}, [pts.map(p => p[0]), pts.map(p => p[1])]);
}}
{script}
</script>
</body></html>
"#,
        data = embed(data),
    )
}

/// The report of one replay, from its summary.
pub fn replay_html(summary: &Value) -> String {
    let plots = |names: &[(&str, &str)]| -> String {
        names
            .iter()
            .map(|(n, t)| {
                format!(r#"<div class="panel"><h2>{t}</h2><div class="plot" data-plot="{n}"></div></div>"#)
            })
            .collect::<String>()
    };
    let body = format!(
        r#"<h1>Cachet replay</h1>
<div class="sub" id="sub"></div>
<div class="cards" id="cards"></div>
<div class="grid">{}</div>
<h2 style="margin-top:20px">Marks</h2><table id="marks"></table>
<h2>Tenants</h2><table id="tenants"></table>
<h2>Nodes</h2><table id="nodes"></table>
<h2>Errors</h2><table id="errkinds"></table>
<h2>Reconciliation with the ledger</h2><div id="recon"></div>"#,
        plots(&[
            ("ttft-cdf", "Time to first token (CDF)"),
            ("tbt-cdf", "Time between tokens (CDF)"),
            ("ttft-time", "Time to first token over time (p50, p99)"),
            ("throughput", "Throughput over time"),
            ("hit-ratio", "Cache hit ratio over time"),
            ("nodes", "Requests per node"),
            ("tokens", "Tokens by class"),
            ("tenants", "Hit ratio per tenant"),
            ("cost", "Cost with vs without caching"),
            ("errors", "Errors over time"),
        ])
    );
    let script = r#"
const c = D.config, f1 = x => (x ?? 0).toFixed(1), pct = x => ((x ?? 0) * 100).toFixed(1) + '%';
const money = n => (n / 1e9).toFixed(4);
document.getElementById('sub').textContent =
  `${D.trace} · ${c.model} · ${c.api} API · breakpoints ${c.breakpoints} · ${c.arrivals} · ${c.tenants} tenant(s) · started ${D.started_at}`;
const cards = [
  ['requests', `${D.ok} ok / ${D.sent}`], ['errors', D.errors],
  ['hit ratio', pct(D.hit_ratio)],
  ...(D.simulated ? [['simulated hit ratio, same cache', pct(D.simulated.token_hit_ratio)]] : []),
  ...(D.simulated_fleet ? [['simulate-fleet TTFT p50 / TBT p50 / hit ratio',
    `${f1(D.simulated_fleet.ttft_p50_ms)} ms / ${(D.simulated_fleet.tbt_p50_ms ?? 0).toFixed(2)} ms / ${pct(D.simulated_fleet.token_hit_ratio)}`]] : []),
  ['TTFT p50 / p90 / p99', `${f1(D.ttft.p50_ms)} / ${f1(D.ttft.p90_ms)} / ${f1(D.ttft.p99_ms)} ms`],
  ['TBT p50 / p90', `${(D.tbt.p50_ms ?? 0).toFixed(2)} / ${(D.tbt.p90_ms ?? 0).toFixed(2)} ms`],
  ['throughput', `${f1(D.throughput.requests_per_sec)} req/s`],
  ['cost', `${money(D.cost.with_cache_nanos)} ${D.cost.currency}`],
  ['saved by caching', pct(D.cost.saved_ratio)],
];
document.getElementById('cards').innerHTML = cards.map(([k, v]) => `<div class="card"><b>${v}</b><span>${k}</span></div>`).join('');
cdf('ttft-cdf', D.ttft, 'TTFT');
cdf('tbt-cdf', D.tbt, 'TBT');
const s = D.series, secs = s.seconds;
plot('ttft-time', marked({
  scales: { x: { time: false } },
  series: [{ label: 's' }, { label: 'p50 ms', stroke: '#2f5cb9', width: 2, spanGaps: true },
           { label: 'p99 ms', stroke: '#b3261e', width: 2, spanGaps: true }],
  axes: [{ label: 'seconds' }, { label: 'ms' }],
}), [secs, s.ttft_p50_ms || [], s.ttft_p99_ms || []]);
plot('throughput', marked({
  scales: { x: { time: false }, tok: {} },
  series: [{ label: 's' }, { label: 'requests/s', stroke: '#2f5cb9', width: 2 },
           { label: 'output tokens/s', stroke: '#d9822b', width: 2, scale: 'tok' }],
  axes: [{ label: 'seconds' }, { label: 'requests/s' }, { side: 1, scale: 'tok', label: 'tokens/s', grid: { show: false } }],
}), [secs, s.done, s.output_tokens]);
plot('hit-ratio', marked({
  scales: { x: { time: false }, y: { range: [0, 1] } },
  series: [{ label: 's' }, { label: 'hit ratio', stroke: '#1b7a3d', width: 2 }],
  axes: [{ label: 'seconds' }, { values: (u, v) => v.map(x => (x * 100).toFixed(0) + '%') }],
}), [secs, s.hit_ratio]);
const nodes = D.nodes || [];
bars('nodes', nodes.map(n => n.node), nodes.map(n => n.requests), 'requests', v => v);
const t = D.tokens;
bars('tokens', ['input', 'write 5m', 'write 1h', 'read', 'output'],
  [t.input_tokens, t.cache_write_5m_tokens, t.cache_write_1h_tokens, t.cache_read_tokens, t.output_tokens],
  'tokens', v => v >= 1e6 ? (v / 1e6).toFixed(1) + 'M' : v >= 1e3 ? (v / 1e3).toFixed(0) + 'k' : v);
bars('tenants', D.tenants.map(x => 'tenant ' + x.tenant), D.tenants.map(x => x.hit_ratio), 'hit ratio', x => (x * 100).toFixed(1) + '%');
bars('cost', ['with caching', 'without caching'], [D.cost.with_cache_nanos / 1e9, D.cost.without_cache_nanos / 1e9],
  D.cost.currency, v => v.toFixed(3));
const kinds = Object.keys(s.errors_by_kind || {});
const colors = ['#b3261e', '#d9822b', '#7a4fd9', '#1b7a3d', '#2f5cb9'];
plot('errors', marked({
  scales: { x: { time: false } },
  series: [{ label: 's' }].concat(kinds.length ? kinds.map((k, i) => ({ label: k, stroke: colors[i % 5], width: 2 }))
                                               : [{ label: 'errors', stroke: '#b3261e', width: 2 }]),
  axes: [{ label: 'seconds' }, { label: 'errors/s' }],
}), [secs].concat(kinds.length ? kinds.map(k => secs.map(i => s.errors_by_kind[k][i] || 0)) : [s.errors]));
document.getElementById('tenants').innerHTML = '<tr><th>tenant</th><th>key</th><th>requests</th><th>errors</th><th>hit ratio</th><th>cost</th><th>without caching</th></tr>' +
  D.tenants.map(x => `<tr><td>${x.tenant}</td><td>${x.key}</td><td>${x.requests}</td><td>${x.errors}</td><td>${pct(x.hit_ratio)}</td><td>${money(x.cost_nanos)}</td><td>${money(x.cost_without_cache_nanos)}</td></tr>`).join('');
const esc = t => String(t).replace(/[&<>"]/g, ch => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[ch]);
const mk = D.marks || [];
document.getElementById('marks').innerHTML = mk.length
  ? '<tr><th>at</th><th>mark</th></tr>' + mk.map(m => `<tr><td>${m.at_secs.toFixed(1)} s</td><td>${esc(m.label)}</td></tr>`).join('')
  : '<tr><td>none (--mark SECONDS=LABEL, or SIGUSR1 during the run)</td></tr>';
document.getElementById('nodes').innerHTML = nodes.length
  ? '<tr><th>node</th><th>requests</th><th>errors</th><th>hit ratio</th><th>TTFT p50 ms</th><th>TTFT p99 ms</th></tr>' +
    nodes.map(n => `<tr><td>${esc(n.node)}</td><td>${n.requests}</td><td>${n.errors}</td><td>${pct(n.hit_ratio)}</td><td>${f1(n.ttft_p50_ms)}</td><td>${f1(n.ttft_p99_ms)}</td></tr>`).join('')
  : '<tr><td>no node named in the answers (a single server)</td></tr>';
const ek = Object.entries(D.error_kinds || {});
const em = D.error_messages || {};
document.getElementById('errkinds').innerHTML = ek.length
  ? '<tr><th>error</th><th>count</th><th>messages</th></tr>' + ek.map(([k, n]) =>
      `<tr><td>${esc(k)}</td><td>${n}</td><td style="text-align:left">${Object.entries(em[k] || {}).map(([m, c]) => `${c} × ${esc(m)}`).join('<br>')}</td></tr>`).join('')
  : '<tr><td class="good">none</td></tr>';
const r = D.reconciliation;
document.getElementById('recon').innerHTML = !r ? 'not run (no finance token)'
  : r.exact ? `<span class="good">exact</span>: ${r.checked} answered requests, each billed what its client saw.`
  : `<span class="bad">${r.missing} missing, ${r.differing} different</span> of ${r.checked}<ul>${r.examples.map(e => '<li>' + e + '</li>').join('')}</ul>`;
"#;
    page("Cachet replay report", summary, &body, script)
}

/// The report of a sweep: TTFT and TBT p90 against the offered rate, with the SLOs.
pub fn sweep_html(sweep: &Value) -> String {
    let body = r#"<h1>Cachet capacity sweep</h1>
<div class="sub" id="sub"></div>
<div class="cards" id="cards"></div>
<div class="grid">
<div class="panel"><h2>TTFT p90 vs offered rate</h2><div class="plot" data-plot="capacity-ttft"></div></div>
<div class="panel"><h2>TBT p90 vs offered rate</h2><div class="plot" data-plot="capacity-tbt"></div></div>
</div>
<h2 style="margin-top:20px">Steps</h2><table id="steps"></table>"#;
    let script = r#"
const st = D.steps, rates = st.map(x => x.rate);
// With --simulate-fleet each step also holds the simulator's prediction for its requests.
const sim = st.some(x => x.simulated);
const fleet = D.simulated_fleet;
document.getElementById('sub').textContent = `${D.trace} · SLOs: TTFT p90 ≤ ${D.slo.ttft_p90_ms} ms, TBT p90 ≤ ${D.slo.tbt_p90_ms} ms · ${D.step_secs} s a step` +
  (sim ? ` · predicted by simulate-fleet (${fleet.profile}, ${fleet.instances} instance(s), ${fleet.routing})` : '');
const cards = [['capacity under the SLOs', D.capacity_rps == null ? 'none met' : D.capacity_rps + ' req/s']];
if (sim) cards.push(['simulate-fleet predicts', D.simulated_capacity_rps == null ? 'none met' : D.simulated_capacity_rps + ' req/s']);
cards.push(['steps', st.length]);
document.getElementById('cards').innerHTML = cards.map(([k, v]) => `<div class="card"><b>${v}</b><span>${k}</span></div>`).join('');
function curve(name, key, slo) {
  const series = [{ label: 'req/s' }, { label: 'p90 ms', stroke: '#2f5cb9', width: 2 }, { label: 'SLO', stroke: '#b3261e', dash: [6, 4] }];
  const data = [rates, st.map(x => x[key]), rates.map(() => slo)];
  if (sim) {
    series.push({ label: 'simulated p90 ms', stroke: '#6b6b6b', dash: [2, 3], width: 2 });
    data.push(st.map(x => x.simulated ? x.simulated[key] : null));
  }
  plot(name, { scales: { x: { time: false } }, series, axes: [{ label: 'offered requests/s' }, { label: 'ms' }] }, data);
}
curve('capacity-ttft', 'ttft_p90_ms', D.slo.ttft_p90_ms);
curve('capacity-tbt', 'tbt_p90_ms', D.slo.tbt_p90_ms);
const yes = ok => `<td class="${ok ? 'good' : 'bad'}">${ok ? 'yes' : 'no'}</td>`;
const simHead = sim ? '<th>simulated TTFT p90 ms</th><th>simulated TBT p90 ms</th><th>simulated hit ratio</th><th>simulated meets</th>' : '';
const simCells = x => !sim ? '' : x.simulated
  ? `<td>${x.simulated.ttft_p90_ms.toFixed(1)}</td><td>${x.simulated.tbt_p90_ms.toFixed(2)}</td><td>${(x.simulated.hit_ratio * 100).toFixed(1)}%</td>${yes(x.simulated.meets)}`
  : '<td></td><td></td><td></td><td></td>';
document.getElementById('steps').innerHTML = `<tr><th>rate</th><th>ok</th><th>errors</th><th>TTFT p90 ms</th><th>TBT p90 ms</th><th>hit ratio</th><th>meets SLOs</th>${simHead}<th>report</th></tr>` +
  st.map(x => `<tr><td>${x.rate}</td><td>${x.ok}</td><td>${x.errors}</td><td>${x.ttft_p90_ms.toFixed(1)}</td><td>${x.tbt_p90_ms.toFixed(2)}</td><td>${(x.hit_ratio * 100).toFixed(1)}%</td>${yes(x.meets)}${simCells(x)}<td><a href="${x.dir}/report.html">${x.dir}</a></td></tr>`).join('');
"#;
    page("Cachet capacity sweep", sweep, body, script)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_data_cannot_close_its_script_element() {
        let v = serde_json::json!({"trace": "</script><script>alert(1)</script>"});
        let html = page("t", &v, "", "");
        assert!(!html.contains("</script><script>alert"));
        assert!(html.contains("\\u003c/script>"));
    }
}
