// The broker's dashboard: polls the broker's /api endpoints and redraws; no build step.
"use strict";

const POLL_MS = 2000;
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

const short = (id) => (id ? id.slice(0, 12) : "–");
const gib = (bytes) => (bytes / 2 ** 30).toFixed(1) + " GiB";
const tflops = (f) => (f >= 1e12 ? (f / 1e12).toFixed(1) + " TFLOP/s" : (f / 1e9).toFixed(0) + " GFLOP/s");

function renderProviders(providers) {
  const body = $("#providers tbody");
  body.replaceChildren(...providers.map((p) => {
    const status = p.banned ? "banned" : p.online ? "online" : "offline";
    const devices = p.devices.length
      ? p.devices.map((d) => `${d.name} (${gib(d.memory_bytes)})${d.busy ? " · busy" : ""}`).join(", ")
      : "–";
    const speed = p.devices.length ? p.devices.map((d) => tflops(d.matmul_flops)).join(", ") : "–";
    return el("tr", { "data-provider-id": p.provider_id, "data-status": status },
      el("td", { class: "id", title: p.provider_id }, short(p.provider_id)),
      el("td", { class: status }, status),
      el("td", {}, devices), el("td", {}, speed),
      el("td", {}, p.online ? p.price_per_gpu_hour.toFixed(3) : "–"),
      el("td", {}, p.online ? p.interruptible_price_per_gpu_hour.toFixed(3) : "–"),
      el("td", {}, p.reliability.toFixed(2)),
      el("td", {}, `${p.leases_completed} / ${p.leases_lost}`),
      el("td", {}, p.earned.toFixed(4)));
  }));
  const online = providers.filter((p) => p.online);
  const devices = online.flatMap((p) => p.devices);
  $("#c-providers").textContent = online.length;
  $("#c-gpus").textContent = `${devices.filter((d) => d.busy).length} / ${devices.length}`;
}

function renderJobs(jobs) {
  const body = $("#jobs tbody");
  body.replaceChildren(...jobs.map((j) => {
    const bar = el("progress", { max: String(j.total || 1), value: String(j.step) });
    const loss = j.metrics.loss !== undefined ? ` loss ${j.metrics.loss.toFixed(3)}` : "";
    return el("tr", { "data-job-id": j.job_id, "data-state": j.state, "data-step": j.step },
      el("td", { class: "id", title: j.job_id }, j.name ? `${j.name} (${short(j.job_id)})` : short(j.job_id)),
      el("td", {}, j.kind),
      el("td", { class: "state-" + j.state }, j.state),
      el("td", {}, bar, ` ${j.step}/${j.total}${loss}`),
      el("td", {}, j.attempt),
      el("td", { class: "id", title: j.provider_id || "" }, short(j.provider_id)),
      el("td", {}, j.cost.toFixed(4)));
  }));
  $("#c-queued").textContent = jobs.filter((j) => j.state === "QUEUED").length;
  $("#c-running").textContent = jobs.filter((j) => j.state === "RUNNING" || j.state === "LEASED").length;
}

function renderEndpoints(endpoints) {
  $("#endpoints tbody").replaceChildren(...endpoints.map((e) => el("tr", { "data-endpoint": e.name },
    el("td", { class: "id", title: e.job_id }, `${e.name} (${short(e.job_id)})`),
    el("td", { class: "state-" + e.state }, e.state),
    el("td", {}, `${e.ready} / ${e.live} (${e.min_replicas}-${e.max_replicas})`),
    el("td", {}, `${e.in_flight} / ${e.queued}`),
    el("td", {}, e.requests),
    el("td", {}, `${e.ttft_p50_ms.toFixed(0)} ms`),
    el("td", {}, `${e.tpot_p50_ms.toFixed(1)} ms`),
    el("td", {}, e.last_event))));
}

function renderLedger(ledger) {
  const check = $("#ledger-check");
  check.textContent = ledger.problems.length ? `· ${ledger.problems.length} problems: ${ledger.problems[0]}` : "· balanced";
  check.className = ledger.problems.length ? "down" : "muted";
  const t = ledger.totals;
  $("#ledger-totals").textContent =
    `credited ${(-t.deposits).toFixed(6)} · available ${t.client.toFixed(6)} · held ${t.escrow.toFixed(6)}` +
    ` · earned ${t.provider.toFixed(6)} · fee ${t.fee.toFixed(6)}` +
    (t.disputed ? ` · disputed ${t.disputed.toFixed(6)}` : "") + (t.stake ? ` · stake ${t.stake.toFixed(6)}` : "");
  $("#ledger tbody").replaceChildren(...ledger.postings.map((p) => el("tr", { "data-seq": p.seq, "data-type": p.type },
    el("td", {}, p.seq),
    el("td", {}, new Date(p.at_ms).toLocaleTimeString()),
    el("td", {}, p.type),
    el("td", { class: "id", title: p.job_id }, p.job_id || "–"),
    el("td", { class: "id", title: p.provider_id }, short(p.provider_id)),
    el("td", {}, p.type === "settle" ? `${p.step_from}→${p.step_to} (${p.seconds.toFixed(1)} s)` : ""),
    el("td", {}, Object.entries(p.entries).map(([a, v]) => `${a.split(":")[0]} ${v > 0 ? "+" : ""}${v.toFixed(6)}`).join(", ")),
    el("td", { class: "memo", title: p.memo }, p.memo))));
}

function renderChart(series) {
  const svg = $("#chart");
  const W = 600, H = 160, pad = 16;
  const samples = series.samples;
  const ns = "http://www.w3.org/2000/svg";
  const node = (tag, attrs) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    return n;
  };
  const parts = [];
  for (const y of [pad, H / 2, H - pad]) parts.push(node("line", { class: "grid", x1: 0, x2: W, y1: y, y2: y }));
  if (samples.length > 1) {
    const t0 = samples[0].at_ms, t1 = samples[samples.length - 1].at_ms;
    const maxQ = Math.max(1, ...samples.map((s) => s.queued));
    const x = (s) => ((s.at_ms - t0) / Math.max(1, t1 - t0)) * W;
    const y = (v) => H - pad - v * (H - 2 * pad);
    const line = (cls, f) => node("polyline", { class: cls, points: samples.map((s) => `${x(s).toFixed(1)},${y(f(s)).toFixed(1)}`).join(" ") });
    parts.push(line("queue", (s) => s.queued / maxQ));
    parts.push(line("util", (s) => (s.gpus ? s.gpus_busy / s.gpus : 0)));
    $("#chart-note").textContent =
      `top of the chart: ${maxQ} queued, 100% busy · last ${Math.max(1, Math.round((t1 - t0) / 60000))} min`;
  }
  svg.replaceChildren(...parts);
}

async function getJSON(path) {
  const resp = await fetch(path, { cache: "no-store" });
  if (!resp.ok) throw new Error(`${path}: ${resp.status}`);
  return resp.json();
}

async function refresh() {
  const status = $("#status");
  try {
    const [providers, jobs, series, ledger, endpoints] = await Promise.all(
      [getJSON("api/providers"), getJSON("api/jobs?limit=50"), getJSON("api/series"),
       getJSON("api/ledger?limit=30"), getJSON("api/endpoints")]);
    renderEndpoints(endpoints.endpoints);
    renderProviders(providers.providers);
    renderJobs(jobs.jobs);
    renderChart(series);
    renderLedger(ledger);
    status.textContent = "live · " + new Date().toLocaleTimeString();
    status.className = "pill live";
  } catch (err) {
    status.textContent = "broker unreachable";
    status.className = "pill down";
  }
  setTimeout(refresh, POLL_MS);
}

refresh();
