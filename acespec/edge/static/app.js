// The edge's live page: streams a chat answer from /v1/chat/completions with "marks" on, colours every
// token by its origin, and plots tokens/s, round trip, K and acceptance per verdict. Plain JavaScript
// and <canvas>: nothing is fetched from anywhere but this edge.
"use strict";

const $ = (id) => document.getElementById(id);
const ORIGINS = { draft: "tok-draft", cache: "tok-cache", target: "tok-target" };
const PLOTS = {
  tps: { canvas: "plot-tps", color: "#1f6feb" },
  rtt: { canvas: "plot-rtt", color: "#b45309" },
  k: { canvas: "plot-k", color: "#047857" },
  acc: { canvas: "plot-acc", color: "#7c3aed", max: 1 },
};
let series = {};
let controller = null;

function resetSeries() {
  series = { tps: [], rtt: [], k: [], acc: [] };
  for (const name in PLOTS) draw(name);
}

// One line per plot, x = seconds since the request was sent; the y scale starts at 0.
function draw(name) {
  const p = PLOTS[name], pts = series[name], c = $(p.canvas), g = c.getContext("2d");
  const w = c.width, h = c.height, pad = 22;
  g.clearRect(0, 0, w, h);
  g.strokeStyle = "#e5e7eb"; g.lineWidth = 1;
  g.beginPath(); g.moveTo(pad, 4); g.lineTo(pad, h - pad); g.lineTo(w - 4, h - pad); g.stroke();
  g.fillStyle = "#6b7280"; g.font = "10px sans-serif";
  if (!pts.length) { g.fillText("waiting for a request", pad + 8, h / 2); return; }
  const tmax = Math.max(pts[pts.length - 1][0], 1e-3);
  const ymax = p.max || Math.max(...pts.map((q) => q[1]), 1e-9) * 1.15;
  const x = (t) => pad + (w - pad - 6) * (t / tmax), y = (v) => h - pad - (h - pad - 6) * (v / ymax);
  g.fillText(fmt(ymax), 1, 12); g.fillText("0", 8, h - pad);
  g.fillText(tmax.toFixed(1) + " s", w - 40, h - 6);
  g.strokeStyle = p.color; g.lineWidth = 1.6; g.beginPath();
  pts.forEach(([t, v], i) => (i ? g.lineTo(x(t), y(v)) : g.moveTo(x(t), y(v))));
  g.stroke();
  g.fillStyle = p.color;
  for (const [t, v] of pts) g.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3);
  const now = "now " + fmt(pts[pts.length - 1][1]);
  g.font = "bold 11px sans-serif";
  const tw = g.measureText(now).width;
  g.fillStyle = "rgba(255,255,255,.85)"; g.fillRect(w - tw - 10, 1, tw + 8, 14);  // readable over the line
  g.fillStyle = p.color; g.fillText(now, w - tw - 6, 12);
}

function fmt(v) { return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2); }

function addToken(text, origin) {
  const span = document.createElement("span");
  span.className = "tok " + (ORIGINS[origin] || "tok-target");
  span.dataset.origin = origin;
  span.textContent = text;
  $("answer").appendChild(span);
  $("output").scrollTop = $("output").scrollHeight;
}

function setState(state, text) {
  $("output").dataset.state = state;
  $("status").textContent = text;
  const busy = state === "streaming";
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || controller) return;
  $("output").innerHTML = "";
  const asked = document.createElement("div");
  asked.id = "asked"; asked.className = "muted"; asked.textContent = "› " + prompt;
  const answer = document.createElement("div");
  answer.id = "answer";
  $("output").append(asked, answer);
  resetSeries();
  const body = {
    model: window.acespecModel || "acespec", messages: [{ role: "user", content: prompt }], stream: true,
    stream_options: { include_usage: true }, marks: true,
    max_tokens: Number($("max_tokens").value), temperature: Number($("temperature").value), seed: Number($("seed").value),
  };
  if ($("mode").value) body.mode = $("mode").value;
  controller = new AbortController();
  setState("streaming", "waiting for the first token…");
  const t0 = performance.now();
  const recent = [];  // [arrival, tokens] of the last verdicts: tokens/s over them, as tokens come in bursts
  let tokens = 0, drafted = 0, accepted = 0, usage = null, failed = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || resp.statusText);
    }
    const reader = resp.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const msg = JSON.parse(data);
        if (msg.error) { failed = msg.error.message; continue; }
        if (msg.usage) usage = msg.usage;
        const marks = msg.acespec;
        if (!marks) continue;
        const t = (performance.now() - t0) / 1000;
        for (const [text, origin] of marks.tokens) addToken(text, origin);
        const n = marks.n;  // tokens the verdict committed (their text may still be held back for `stop`)
        tokens += n;
        recent.push([t, n]);
        if (recent.length > 6) recent.shift();
        if (recent.length > 1) {  // the tokens that came after the oldest verdict kept, over the time since it
          const span = t - recent[0][0];
          const got = recent.slice(1).reduce((sum, r) => sum + r[1], 0);
          if (span > 0) series.tps.push([t, got / span]);
        }
        if (marks.rtt_ms !== null) series.rtt.push([t, marks.rtt_ms]);
        if (marks.latency_ms !== null) {
          series.k.push([t, marks.k]);
          if (marks.k > 0) {
            drafted += marks.k; accepted += marks.accepted;
            series.acc.push([t, marks.accepted / marks.k]);
          }
        }
        for (const name in PLOTS) draw(name);
        setState("streaming", `${tokens} tokens, ${(tokens / t).toFixed(1)} tok/s` +
          (drafted ? `, acceptance ${(accepted / drafted).toFixed(2)}` : ""));
      }
    }
    if (failed) throw new Error(failed);
    const secs = (performance.now() - t0) / 1000;
    let text = `done: ${usage ? usage.completion_tokens : tokens} tokens in ${secs.toFixed(2)} s`;
    if (usage) {
      text += `, ${usage.accepted_tokens}/${usage.drafted_tokens} draft tokens accepted, ` +
        `${usage.target_passes} target passes, state cache ${usage.cache_hits}/${usage.cache_lookups} hits`;
    }
    setState("done", text);
  } catch (e) {
    setState(e.name === "AbortError" ? "stopped" : "error", e.name === "AbortError" ? "stopped" : "error: " + e.message);
  } finally {
    controller = null;
  }
}

$("form").addEventListener("submit", send);
$("stop").addEventListener("click", () => controller && controller.abort());
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("form").requestSubmit(); });
fetch("/v1/models").then((r) => r.json()).then((m) => {
  window.acespecModel = m.data[0].id;
  $("model").textContent = "model " + m.data[0].id;
}).catch(() => {});
resetSeries();
