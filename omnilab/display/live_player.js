// omnilab's streaming player (anywidget ESM; omnilab/display/live.py is the Python side).
//
// The model holds `chunks` (a list of float32 PCM buffers, one per streamed AudioChunk, in order), `sample_rate`,
// `normalize`, `status` (HTML) and `plot_png` (bytes, empty until the first plot). Pressing play starts a Web Audio
// context; every chunk, the ones already there and each one that arrives later, is scheduled as an AudioBuffer
// right after the previous one, so what is playing goes on while the stream grows. The position marker shows the
// played and received audio; `data-chunks`, `data-scheduled-s` and `data-position-s` on the root element expose them.

function asFloat32(buf) {
  if (buf instanceof DataView) return new Float32Array(buf.buffer, buf.byteOffset, buf.byteLength / 4);
  if (buf instanceof ArrayBuffer) return new Float32Array(buf);
  if (ArrayBuffer.isView(buf)) return new Float32Array(buf.buffer, buf.byteOffset, buf.byteLength / 4);
  return new Float32Array(0);
}

function fmt(s) {
  const m = Math.floor(s / 60);
  return `${m}:${(s - 60 * m).toFixed(2).padStart(5, "0")}`;
}

function render({ model, el }) {
  el.classList.add("omnilab-live");
  el.innerHTML = `
    <div style="display:flex;gap:12px;align-items:flex-start;font-family:sans-serif;font-size:13px">
      <div style="width:340px">
        <div class="omnilab-live-status"></div>
        <div style="display:flex;gap:8px;align-items:center;margin-top:6px">
          <button class="omnilab-live-play" style="width:64px">play</button>
          <div class="omnilab-live-bar" style="position:relative;flex:1;height:10px;background:#eee;border-radius:3px">
            <div class="omnilab-live-have" style="position:absolute;left:0;top:0;bottom:0;width:0;background:#cde"></div>
            <div class="omnilab-live-pos" style="position:absolute;left:0;top:-2px;bottom:-2px;width:3px;background:#c33"></div>
          </div>
        </div>
        <div class="omnilab-live-time" style="margin-top:4px;color:#555">0:00.00 / 0:00.00</div>
      </div>
      <div class="omnilab-live-plot" style="width:640px;height:192px;display:flex;align-items:center;
           justify-content:center;border:1px dashed #bbb;color:#888">waiting for the first chunk...</div>
    </div>`;
  const status = el.querySelector(".omnilab-live-status");
  const button = el.querySelector(".omnilab-live-play");
  const have = el.querySelector(".omnilab-live-have");
  const pos = el.querySelector(".omnilab-live-pos");
  const time = el.querySelector(".omnilab-live-time");
  const plot = el.querySelector(".omnilab-live-plot");

  let ctx = null, gain = null, next = 0, scheduled = 0, segments = [], peak = 0, url = null;
  let playing = false;

  const chunks = () => model.get("chunks") || [];
  const sr = () => model.get("sample_rate") || 24000;
  const received = () => chunks().reduce((n, c) => n + asFloat32(c).length, 0) / sr();

  function position() {  // seconds of audio played so far (stays put while waiting for the next chunk)
    if (!ctx) return 0;
    let p = 0;
    for (const s of segments) {
      if (ctx.currentTime >= s.start) p = s.offset + Math.min(ctx.currentTime - s.start, s.dur);
    }
    return p;
  }

  function setGain() {
    if (gain) gain.gain.value = model.get("normalize") && peak > 0 ? 1 / peak : 1;
  }

  function schedule() {  // every received chunk not yet scheduled goes right after the previous one
    if (!ctx) return;
    const list = chunks();
    while (scheduled < list.length) {
      const pcm = asFloat32(list[scheduled]);
      scheduled += 1;
      if (!pcm.length) continue;
      for (let i = 0; i < pcm.length; i++) peak = Math.max(peak, Math.abs(pcm[i]));
      setGain();
      const buf = ctx.createBuffer(1, pcm.length, sr());
      buf.copyToChannel(pcm, 0);
      const src = ctx.createBufferSource();
      src.buffer = buf;
      src.connect(gain);
      const start = Math.max(next, ctx.currentTime + 0.03);
      const offset = segments.length ? segments[segments.length - 1].offset + segments[segments.length - 1].dur : 0;
      src.start(start);
      segments.push({ start, dur: buf.duration, offset });
      next = start + buf.duration;
    }
  }

  function tick() {
    const total = received();
    const p = Math.min(position(), total);
    const ended = ctx && scheduled === chunks().length && ctx.currentTime >= next && model.get("done");
    if (ended && playing) { playing = false; button.textContent = "replay"; }
    have.style.width = total > 0 ? "100%" : "0";
    pos.style.left = total > 0 ? `calc(${(100 * p / total).toFixed(2)}% - 1px)` : "0";
    time.textContent = `${fmt(p)} / ${fmt(total)}${model.get("done") ? "" : " (streaming)"}`;
    el.dataset.chunks = String(chunks().length);
    el.dataset.scheduledS = ctx ? String(segments.reduce((n, s) => n + s.dur, 0)) : "0";
    el.dataset.positionS = String(p);
  }

  async function start() {
    if (ctx) { try { await ctx.close(); } catch (e) { /* already closed */ } }
    ctx = new AudioContext();
    gain = ctx.createGain();
    gain.connect(ctx.destination);
    next = 0; scheduled = 0; segments = []; peak = 0;
    schedule();
    await ctx.resume();
  }

  button.addEventListener("click", async () => {
    if (!ctx || button.textContent === "replay") {
      await start();
      playing = true;
    } else if (playing) {
      await ctx.suspend();
      playing = false;
    } else {
      await ctx.resume();
      playing = true;
    }
    button.textContent = playing ? "pause" : "play";
  });

  function showStatus() { status.innerHTML = model.get("status"); }
  function showPlot() {
    const png = model.get("plot_png");
    const bytes = png && (png.byteLength || png.length);
    if (!bytes) return;
    if (url) URL.revokeObjectURL(url);
    url = URL.createObjectURL(new Blob([png], { type: "image/png" }));
    plot.style.border = "none";
    plot.innerHTML = "";
    const img = document.createElement("img");
    img.src = url;
    img.alt = "stream plot";
    img.style.maxWidth = "640px";
    plot.appendChild(img);
  }

  model.on("change:chunks", () => { schedule(); tick(); });
  model.on("change:status", showStatus);
  model.on("change:plot_png", showPlot);
  model.on("change:normalize", setGain);
  showStatus();
  showPlot();
  tick();
  const timer = setInterval(tick, 50);
  return () => {
    clearInterval(timer);
    if (ctx) ctx.close();
    if (url) URL.revokeObjectURL(url);
  };
}

export default { render };
