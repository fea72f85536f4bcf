"""The page at ``/``: type a sentence, pick a voice (or give a clip on a Base model), hear it stream through Web
Audio (raw PCM chunks scheduled back to back) with the time to first audio shown. No external resources."""

PAGE_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>omnilab speech</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:15px system-ui,sans-serif;max-width:44rem;margin:2rem auto;padding:0 1rem;color:#222}
textarea,input,select,button{font:inherit;margin:.2rem 0}textarea{width:100%;height:5rem}
label{display:block;margin-top:.6rem}#stats{margin-top:1rem;font-family:monospace;white-space:pre}
.err{color:#b00}.hidden{display:none}
</style></head><body>
<h1>omnilab speech</h1>
<p id="model">loading…</p>
<label>Text<textarea id="text">Hello from omnilab, running on the CPU.</textarea></label>
<label id="voice-row">Voice <select id="voice"></select></label>
<label id="instr-row" class="hidden">Voice description (VoiceDesign)
  <input id="instructions" size="50" value="A calm, low voice."></label>
<label id="clip-row" class="hidden">Reference clip (Base) <input id="clip" type="file" accept="audio/*"></label>
<label>Max frames (80 ms each) <input id="max" type="number" value="60" min="1"></label>
<label>API key <input id="key" type="password" size="30"></label>
<button id="speak">Speak</button> <button id="stop" disabled>Stop</button>
<div id="stats"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
$("key").value = params.get("api_key") || "";
const stats = window.omnilabStats = {state: "idle"};
let task = "CustomVoice", ctx = null, abort = null;
function headers(json) {
  const h = json ? {"Content-Type": "application/json"} : {};
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}
function show(msg, err) { $("stats").textContent = msg; $("stats").className = err ? "err" : ""; }
async function init() {
  const r = await fetch("/v1/audio/voices", {headers: headers(false)});
  if (!r.ok) { show("voices: " + r.status + " " + (await r.text()), true); return; }
  const v = await r.json();
  task = v.task_type;
  $("model").textContent = "model: " + task;
  const sel = $("voice"); sel.innerHTML = "";
  if (task !== "CustomVoice") sel.add(new Option(task === "Base" ? "(reference clip)" : "(designed)", ""));
  for (const name of v.voices) sel.add(new Option(name, name));
  $("instr-row").classList.toggle("hidden", task !== "VoiceDesign");
  $("clip-row").classList.toggle("hidden", task !== "Base");
  document.body.dataset.ready = "1";
}
function readClip() {
  const f = $("clip").files[0];
  if (!f) return Promise.resolve(null);
  return new Promise((ok, bad) => { const fr = new FileReader(); fr.onload = () => ok(fr.result);
    fr.onerror = bad; fr.readAsDataURL(f); });
}
async function speak() {
  if (abort) abort.abort();
  ctx = ctx || new AudioContext({sampleRate: 24000});
  await ctx.resume();
  Object.assign(stats, {state: "running", ttfa_ms: null, samples: 0, chunks: 0, played: 0, error: null});
  const body = {input: $("text").value, response_format: "pcm", stream_format: "audio",
                max_new_tokens: parseInt($("max").value, 10)};
  if ($("voice").value) body.voice = $("voice").value;
  if (task === "VoiceDesign") { body.task_type = "VoiceDesign"; body.instructions = $("instructions").value; }
  if (task === "Base" && !body.voice) { body.task_type = "Base"; const clip = await readClip(); if (clip) body.ref_audio = clip; }
  abort = new AbortController(); $("stop").disabled = false;
  const t0 = performance.now();
  let next = 0, carry = null;
  show("waiting for the first audio…");
  try {
    const r = await fetch("/v1/audio/speech", {method: "POST", headers: headers(true), body: JSON.stringify(body),
                                               signal: abort.signal});
    if (!r.ok) { const e = await r.json().catch(() => ({})); throw new Error(r.status + ": " + ((e.error || {}).message || r.statusText)); }
    const reader = r.body.getReader();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      let bytes = value;
      if (carry) { const b = new Uint8Array(carry.length + bytes.length); b.set(carry); b.set(bytes, carry.length); bytes = b; carry = null; }
      if (bytes.length % 2) { carry = bytes.slice(bytes.length - 1); bytes = bytes.slice(0, bytes.length - 1); }
      if (!bytes.length) continue;
      const pcm = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.length / 2);
      const f = new Float32Array(pcm.length);
      for (let i = 0; i < pcm.length; i++) f[i] = pcm[i] / 32768;
      if (stats.ttfa_ms === null) stats.ttfa_ms = Math.round(performance.now() - t0);
      const buf = ctx.createBuffer(1, f.length, 24000); buf.copyToChannel(f, 0);
      const src = ctx.createBufferSource(); src.buffer = buf; src.connect(ctx.destination);
      src.onended = () => { stats.played++; };
      next = Math.max(next, ctx.currentTime + 0.02); src.start(next); next += buf.duration;
      stats.samples += f.length; stats.chunks++;
      show(`TTFA ${stats.ttfa_ms} ms\nreceived ${(stats.samples / 24000).toFixed(2)} s in ${stats.chunks} chunk(s)`);
    }
    stats.state = "done";
    show(`TTFA ${stats.ttfa_ms} ms\nreceived ${(stats.samples / 24000).toFixed(2)} s in ${stats.chunks} chunk(s), done`);
  } catch (e) {
    stats.state = "error"; stats.error = String(e.message || e);
    if (e.name !== "AbortError") show(stats.error, true); else show("stopped");
  } finally { $("stop").disabled = true; }
}
$("speak").onclick = speak;
$("stop").onclick = () => { if (abort) abort.abort(); };
init().catch((e) => show(String(e), true));
</script></body></html>
"""
