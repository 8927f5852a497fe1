"""The page `swarm monitor` serves: one self-contained HTML document (inline CSS and JS, nothing fetched
from elsewhere, so it works on machines with no internet). It polls `/api/swarm` every couple of
seconds and draws the tables and the loss and samples/s charts from it. Text from the network is
set with textContent, never parsed as HTML.
"""

from __future__ import annotations

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarm monitor</title>
<style>
  :root { --ink: #1f2933; --muted: #6b7785; --line: #e3e7ec; --bg: #f5f7fa; --card: #ffffff;
          --ok: #2b8a3e; --warn: #e8a317; --bad: #c92a2a; --bar: #4c6ef5; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink);
         background: var(--bg); }
  header { display: flex; align-items: center; gap: 16px; padding: 12px 20px; background: #202a36;
           color: #fff; }
  header h1 { font-size: 18px; margin: 0; font-weight: 600; }
  header .run { color: #c5ced8; }
  #live { margin-left: auto; padding: 2px 10px; border-radius: 10px; font-size: 12px; font-weight: 600;
          background: var(--muted); }
  #live.ok { background: var(--ok); }
  #live.bad { background: var(--bad); }
  main { padding: 14px 20px; display: grid; gap: 14px; }
  .cards { display: grid; grid-template-columns: repeat(5, 1fr); gap: 12px; }
  .card, section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; }
  .card { padding: 10px 14px; }
  .card .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
  .card .value { font-size: 22px; font-weight: 600; margin-top: 2px; }
  .card .sub { color: var(--muted); font-size: 12px; }
  .row { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
  section { padding: 10px 14px; overflow-x: auto; }
  section h2 { font-size: 13px; margin: 0 0 8px; color: var(--muted); text-transform: uppercase;
               letter-spacing: .04em; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: right; padding: 4px 8px; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { color: var(--muted); font-weight: 500; font-size: 12px; }
  th:first-child, td:first-child, th.text, td.text { text-align: left; }
  td.mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; text-align: left; }
  .state { padding: 1px 8px; border-radius: 9px; font-size: 12px; color: #fff; }
  .state.serving { background: var(--ok); }
  .state.joining { background: var(--warn); }
  .state.leaving { background: var(--muted); }
  .tag { padding: 1px 6px; border-radius: 4px; font-size: 11px; background: #ffe3e3; color: var(--bad); }
  .loadbar { position: relative; width: 160px; height: 12px; background: #edf0f4; border-radius: 3px;
             display: inline-block; vertical-align: middle; }
  .loadbar .fill { position: absolute; left: 0; top: 0; bottom: 0; background: var(--bar); border-radius: 3px; }
  .loadbar .fill.low { background: var(--bad); }
  .loadbar .ideal { position: absolute; top: -2px; bottom: -2px; width: 2px; background: var(--ink); }
  svg.chart { width: 100%; height: 220px; display: block; }
  svg.chart .axis { stroke: #b8c0ca; stroke-width: 1; }
  svg.chart .grid { stroke: var(--line); stroke-width: 1; }
  svg.chart text { fill: var(--muted); font-size: 11px; }
  svg.chart .series { fill: none; stroke-width: 2.5; stroke-linejoin: round; }
  .empty { color: var(--muted); padding: 8px 0; }
  .legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
  .legend i { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 4px; }
</style>
</head>
<body>
<header>
  <h1>swarm monitor</h1><span class="run" id="run"></span><span class="run" id="model"></span>
  <span id="live">connecting</span>
</header>
<main>
  <div class="cards">
    <div class="card"><div class="label">Stages served</div><div class="value" id="stages-served">-</div>
      <div class="sub" id="stages-sub"></div></div>
    <div class="card"><div class="label">Peers</div><div class="value" id="peer-count">-</div>
      <div class="sub" id="peer-sub"></div></div>
    <div class="card"><div class="label">Pipeline samples/s</div><div class="value" id="throughput">-</div>
      <div class="sub" id="throughput-sub"></div></div>
    <div class="card"><div class="label">Trainers</div><div class="value" id="trainer-count">-</div>
      <div class="sub" id="trainer-sub"></div></div>
    <div class="card"><div class="label">Bans issued</div><div class="value" id="bans">-</div>
      <div class="sub" id="bans-sub"></div></div>
  </div>
  <div class="row">
    <section><h2>Loss</h2><svg class="chart" id="loss-chart"></svg><div class="legend" id="loss-legend"></div>
    </section>
    <section><h2>Samples/s (per trainer)</h2><svg class="chart" id="rate-chart"></svg>
      <div class="legend" id="rate-legend"></div></section>
  </div>
  <section><h2>Stages and balance</h2>
    <table id="stages"><thead><tr><th>stage</th><th>serving</th><th>joining</th><th>step</th><th>queue</th>
      <th>stale</th><th>cost</th><th>capacity (samples/s)</th><th class="text">load vs ideal</th><th></th></tr></thead>
      <tbody></tbody></table>
    <div class="empty" id="moves"></div>
  </section>
  <section><h2>Peers</h2>
    <table id="peers"><thead><tr><th>peer</th><th>stage</th><th class="text">state</th><th>step</th><th>samples/s</th>
      <th>queue</th><th>stale</th><th>record expires</th><th class="text">banned by</th></tr></thead>
      <tbody></tbody></table>
  </section>
  <section><h2>Trainers</h2>
    <table id="trainers"><thead><tr><th>trainer</th><th>step</th><th>loss</th><th>samples/s</th><th>samples</th>
      <th>bans issued</th><th class="text">banning now</th><th>record expires</th></tr></thead>
      <tbody></tbody></table>
  </section>
</main>
<script>
"use strict";
const PERIOD_MS = 2000;
const COLORS = ["#d9480f", "#1971c2", "#2f9e44", "#9c36b5", "#e67700", "#0c8599", "#c2255c", "#5c940d"];
const trainerColors = new Map();
const SVG = "http://www.w3.org/2000/svg";

function colorOf(trainer) {
  if (!trainerColors.has(trainer)) trainerColors.set(trainer, COLORS[trainerColors.size % COLORS.length]);
  return trainerColors.get(trainer);
}
function short(id) { return id.length > 14 ? "\u2026" + id.slice(-12) : id; }
function num(x, digits) {
  if (x === null || x === undefined || !isFinite(x)) return "-";
  return Number(x).toFixed(digits === undefined ? 1 : digits);
}
function duration(seconds) {
  if (seconds < 120) return seconds + "s";
  if (seconds < 7200) return Math.round(seconds / 60) + "m";
  return (seconds / 3600).toFixed(1) + "h";
}
function setText(id, text) { document.getElementById(id).textContent = text; }
function cell(row, text, cls) {
  const td = document.createElement("td");
  if (text instanceof Node) td.appendChild(text); else td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}
function badge(text, cls) {
  const span = document.createElement("span");
  span.className = cls;
  span.textContent = text;
  return span;
}
function fillTable(id, items, fill) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  for (const item of items) {
    const row = document.createElement("tr");
    fill(row, item);
    body.appendChild(row);
  }
}

function loadBar(load) {
  const bar = document.createElement("span");
  bar.className = "loadbar";
  if (load === null) return bar;
  const scale = 1.5;  // the bar spans 0..150% of the ideal
  const fill = document.createElement("span");
  fill.className = "fill" + (load < 0.9 ? " low" : "");
  fill.style.width = Math.min(100, (100 * load) / scale) + "%";
  const ideal = document.createElement("span");
  ideal.className = "ideal";
  ideal.style.left = (100 / scale) + "%";
  bar.append(fill, ideal);
  return bar;
}

function drawChart(svg, legend, series, valueIndex, unit) {
  svg.replaceChildren();
  legend.replaceChildren();
  const width = svg.clientWidth || 560, height = svg.clientHeight || 220;
  const left = 52, right = 12, top = 10, bottom = 26;
  const all = [];
  for (const points of Object.values(series)) for (const p of points) all.push(p);
  if (all.length === 0) {
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", width / 2);
    text.setAttribute("y", height / 2);
    text.setAttribute("text-anchor", "middle");
    text.textContent = "waiting for a trainer's first step";
    svg.appendChild(text);
    return;
  }
  const t1 = Math.max(...all.map(p => p[0])), t0 = Math.min(...all.map(p => p[0]), t1 - 10);
  let y0 = Math.min(...all.map(p => p[valueIndex])), y1 = Math.max(...all.map(p => p[valueIndex]));
  if (y1 - y0 < 1e-9) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.08;
  y0 = Math.max(0, y0 - pad); y1 += pad;
  const x = t => left + ((t - t0) / (t1 - t0)) * (width - left - right);
  const y = v => top + (1 - (v - y0) / (y1 - y0)) * (height - top - bottom);
  const line = (x1, y1_, x2, y2, cls) => {
    const el = document.createElementNS(SVG, "line");
    el.setAttribute("x1", x1); el.setAttribute("y1", y1_); el.setAttribute("x2", x2); el.setAttribute("y2", y2);
    el.setAttribute("class", cls);
    svg.appendChild(el);
  };
  const label = (px, py, text, anchor) => {
    const el = document.createElementNS(SVG, "text");
    el.setAttribute("x", px); el.setAttribute("y", py); el.setAttribute("text-anchor", anchor);
    el.textContent = text;
    svg.appendChild(el);
  };
  for (let i = 0; i <= 4; i++) {
    const v = y0 + ((y1 - y0) * i) / 4;
    line(left, y(v), width - right, y(v), "grid");
    label(left - 6, y(v) + 4, num(v, v >= 100 ? 0 : 2), "end");
  }
  for (let i = 0; i <= 4; i++) {
    const t = t0 + ((t1 - t0) * i) / 4;
    const ago = Math.round(t1 - t);
    label(x(t), height - 8, i < 4 ? "-" + duration(ago) : "now", i < 4 ? "middle" : "end");
  }
  line(left, top, left, height - bottom, "axis");
  line(left, height - bottom, width - right, height - bottom, "axis");
  for (const [trainer, points] of Object.entries(series)) {
    if (points.length === 0) continue;
    const path = document.createElementNS(SVG, "path");
    const d = points.map((p, i) => (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[valueIndex]).toFixed(1));
    if (points.length === 1) d.push("l 0.1 0");
    path.setAttribute("d", d.join(" "));
    path.setAttribute("class", "series");
    path.setAttribute("stroke", colorOf(trainer));
    path.dataset.trainer = trainer;
    path.dataset.points = points.length;
    svg.appendChild(path);
    const last = points[points.length - 1];
    const key = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = colorOf(trainer);
    key.append(swatch, short(trainer) + ": " + num(last[valueIndex], 3) + unit);
    legend.appendChild(key);
  }
}

function render(s) {
  setText("run", "run " + s.run_id);
  setText("model", s.model ? s.model + ", " + s.num_stages + " stages" : s.num_stages + " stages");
  setText("stages-served", s.stages_served + "/" + s.num_stages);
  const empty = s.stages.filter(st => st.serving === 0).map(st => st.stage);
  setText("stages-sub", empty.length ? "no serving peer: stage " + empty.join(", ") : "every stage served");
  setText("peer-count", s.peers.length);
  const serving = s.peers.filter(p => p.state === "serving").length;
  setText("peer-sub", serving + " serving, " + (s.peers.length - serving) + " joining or leaving");
  const b = s.balance;
  setText("throughput", num(b.throughput));
  setText("throughput-sub", "ideal " + num(b.ideal_throughput) + (b.bottleneck === null ? "" :
          ", bottleneck stage " + b.bottleneck));
  setText("trainer-count", s.trainers.filter(t => !t.finished).length);
  setText("trainer-sub", s.trainers.length ? "max step " + Math.max(...s.trainers.map(t => t.step)) : "none yet");
  setText("bans", s.bans_issued);
  const bannedNow = s.peers.filter(p => p.banned_by > 0).length;
  setText("bans-sub", bannedNow + " peer(s) banned now");

  fillTable("stages", s.stages, (row, st) => {
    cell(row, st.stage);
    cell(row, st.serving);
    cell(row, st.joining);
    cell(row, st.step === null ? "-" : st.step);
    cell(row, st.queue);
    cell(row, st.stale_gradients);
    cell(row, num(st.cost, 2));
    cell(row, num(st.capacity));
    const td = cell(row, loadBar(st.load), "text");
    td.append(" " + (st.load === null ? "-" : Math.round(100 * st.load) + "%"));
    cell(row, st.bottleneck ? badge("bottleneck", "tag") : "", "text");
  });
  setText("moves", b.moves.length ? "The balance rule would move: " + b.moves.map(m => short(m.peer_id) +
          " " + m.source + "\u2192" + m.target).join(", ") : "The balance rule plans no move.");
  fillTable("peers", s.peers, (row, p) => {
    cell(row, short(p.peer_id), "mono").title = p.peer_id;
    cell(row, p.stage);
    cell(row, badge(p.state, "state " + p.state), "text");
    cell(row, p.step);
    cell(row, num(p.throughput));
    cell(row, p.queue);
    cell(row, p.stale_gradients);
    cell(row, num(p.expires_in) + "s");
    cell(row, p.banned_by ? badge(p.banned_by + " trainer(s)", "tag") : "-", "text");
  });
  fillTable("trainers", s.trainers, (row, t) => {
    const td = cell(row, short(t.peer_id), "mono");
    td.title = t.peer_id;
    td.style.color = colorOf(t.peer_id);
    cell(row, t.step);
    cell(row, num(t.loss, 3));
    cell(row, num(t.samples_per_second));
    cell(row, t.samples);
    cell(row, t.bans_issued);
    cell(row, t.banned.length ? t.banned.map(short).join(", ") : "-", "text");
    cell(row, t.finished ? "finished" : num(t.expires_in) + "s");
  });
  drawChart(document.getElementById("loss-chart"), document.getElementById("loss-legend"), s.history, 2, "");
  drawChart(document.getElementById("rate-chart"), document.getElementById("rate-legend"), s.history, 3,
            " samples/s");
}

function setLive(ok, text) {
  const el = document.getElementById("live");
  el.className = ok ? "ok" : "bad";
  el.textContent = text;
}

async function poll() {
  try {
    const reply = await fetch("/api/swarm", {cache: "no-store"});
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    const snapshot = await reply.json();
    render(snapshot);
    if (snapshot.error) setLive(false, "DHT: " + snapshot.error);
    else if (snapshot.age === null) setLive(false, "reading the DHT");
    else if (snapshot.age > 30) setLive(false, "stale: last read " + Math.round(snapshot.age) + "s ago");
    else setLive(true, "live, updated " + new Date().toLocaleTimeString());
    document.body.dataset.updated = String(snapshot.time);
  } catch (e) {
    setLive(false, "monitor unreachable (" + e.message + ")");
  }
  setTimeout(poll, PERIOD_MS);
}
poll();
</script>
</body>
</html>
"""
