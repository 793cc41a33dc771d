// Time-series charts (uPlot: small, fast, canvas-based). Each chart has a text alternative
// for screen readers: its summary, given by the caller.

import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { useEffect, useRef } from "preact/hooks";

export interface Series {
  label: string;
  values: (number | null)[];
  color: string;
  /** Fill under the line. */
  fill?: boolean;
}

export function TimeChart(props: {
  title: string;
  /** Bucket starts, as RFC 3339. */
  times: string[];
  series: Series[];
  /** How the axis shows values. */
  format: (v: number) => string;
  /** What the chart shows, in words (its accessible description). */
  summary: string;
  /** Fix the value axis to this range (ratios: [0, 1]). */
  range?: [number, number];
  /** The time axis: the window asked for (RFC 3339). */
  window: [string, string];
}) {
  const box = useRef<HTMLDivElement>(null);
  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const xs = props.times.map((t) => new Date(t).getTime() / 1000);
    const data: uPlot.AlignedData = [xs, ...props.series.map((s) => s.values)];
    const opts: uPlot.Options = {
      width: Math.max(280, el.clientWidth),
      height: 220,
      legend: { show: true },
      cursor: { drag: { x: false, y: false } },
      scales: {
        x: { time: true, range: () => [new Date(props.window[0]).getTime() / 1000, new Date(props.window[1]).getTime() / 1000] },
        y: props.range ? { range: () => props.range! } : { range: (_u, _min, max) => [0, max > 0 ? max * 1.1 : 1] },
      },
      axes: [
        { stroke: "#555" },
        { stroke: "#555", size: 70, values: (_u, vals) => vals.map((v) => props.format(v)) },
      ],
      series: [
        { label: "time" },
        ...props.series.map((s) => ({
          label: s.label,
          stroke: s.color,
          width: 2,
          fill: s.fill ? `${s.color}33` : undefined,
          points: { show: xs.length < 40 },
          value: (_u: uPlot, v: number | null) => (v === null ? "–" : props.format(v)),
        })),
      ],
    };
    const plot = new uPlot(opts, data, el);
    const ro = new ResizeObserver(() => plot.setSize({ width: Math.max(280, el.clientWidth), height: 220 }));
    ro.observe(el);
    return () => {
      ro.disconnect();
      plot.destroy();
    };
  }, [props.times, props.series, props.range, props.window]);
  return (
    <figure class="chart">
      <figcaption>{props.title}</figcaption>
      <div ref={box} role="img" aria-label={`${props.title}: ${props.summary}`} data-chart={props.title} />
    </figure>
  );
}
