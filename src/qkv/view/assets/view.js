// qkv's head viewer: reads the JSON in #qkv-data, draws on canvases, talks to no server.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("qkv-data").textContent);
  const L = D.layers, H = D.heads, K = D.k, S = D.thumb, T = D.tokens.length;
  const bytes = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
  const frames = D.frames.map((f) => ({
    label: f.label, scores: f.scores, steps: f.steps, losses: f.losses, thumbs: bytes(f.thumbs),
    keys: new Uint16Array(bytes(f.keys).buffer), weights: bytes(f.weights),
  }));
  const state = { frame: frames.length - 1, layer: null, head: null, hover: null };
  const api = { state: state, ready: false, draws: 0 };
  window.qkvView = api;
  const el = (tag, attrs, ...kids) => {
    const e = document.createElement(tag);
    Object.assign(e, attrs || {});
    kids.forEach((k) => e.append(k));
    return e;
  };
  // Control characters (NUL, ESC, …) shown as their Control Pictures (␀, ␛), not dropped or
  // obeyed by the browser.
  const visible = (t) => String(t).replace(/[\x00-\x1f\x7f]/g,
    (c) => String.fromCharCode(c === "\x7f" ? 0x2421 : 0x2400 + c.charCodeAt(0)));
  const esc = (t) => visible(t).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  // A label as shown: visible, and at most 40 characters (a long one ends in "…").
  const shorten = (t) => { const v = visible(t); return v.length > 40 ? v.slice(0, 39) + "…" : v; };
  const lab = (t) => esc(shorten(t));
  const fmt = (x, n) => (x === null || x === undefined ? "" : Number(x).toFixed(n === undefined ? 3 : n));
  // white -> dark blue, on a square-root scale so that small weights stay visible
  const shade = (v) => { const s = Math.sqrt(v); return [255 - 220 * s, 255 - 180 * s, 255 - 90 * s]; };

  const root = document.getElementById("qkv");
  root.append(el("h1", { textContent: D.title }));
  const bar = el("div", { className: "qkv-bar" });
  root.append(bar);
  const frameLabel = el("span", { id: "qkv-frame-label" });
  if (frames.length > 1) {
    const slider = el("input", { type: "range", id: "qkv-slider", min: 0, max: frames.length - 1,
      value: state.frame });
    slider.addEventListener("input", () => { state.frame = +slider.value; redraw(); });
    bar.append(el("label", { textContent: "training step " }, slider), frameLabel);
  }
  bar.append(el("span", { className: "qkv-muted", textContent: `${L} layers × ${H} heads · ` +
    `${T} tokens · each row's ${K} strongest keys kept` }));
  const ablated = new Set((D.ablated || []).map(([l, h]) => `${l}.${h}`));
  if (ablated.size) {
    bar.append(el("span", { id: "qkv-ablated", className: "qkv-ablated-note", textContent:
      `ablated (${D.ablation}): ${[...ablated].join(", ")} — patterns, scores and losses ` +
      "are the model's without them" }));
  }

  const main = el("div", { className: "qkv-main" });
  root.append(main);
  const grid = el("table", { className: "qkv-grid", id: "qkv-grid" });
  main.append(grid);
  const head = el("tr", {}, el("th"));
  for (let h = 0; h < H; h++) head.append(el("th", { textContent: `head ${h}` }));
  grid.append(head);
  const cells = [];
  for (let l = 0; l < L; l++) {
    const tr = el("tr", {}, el("th", { textContent: `layer ${l}` }));
    cells.push([]);
    for (let h = 0; h < H; h++) {
      const canvas = el("canvas", { width: S, height: S });
      const scores = el("div", { className: "qkv-s" });
      const cell = el("div", { className: "qkv-cell", id: `qkv-cell-${l}-${h}` }, canvas, scores);
      if (ablated.has(`${l}.${h}`)) { cell.classList.add("ablated"); cell.title = "ablated"; }
      cell.dataset.layer = l; cell.dataset.head = h;
      cell.addEventListener("click", () => select(l, h));
      tr.append(el("td", {}, cell));
      cells[l].push({ cell, canvas, scores });
    }
    grid.append(tr);
  }

  const side = el("div", { className: "qkv-detail" });
  main.append(side);
  const title = el("div", { id: "qkv-detail-title", className: "qkv-muted",
    textContent: "click a head to see its whole pattern" });
  const N = Math.min(T, 640) * Math.max(1, Math.floor(320 / Math.min(T, 640)));
  const big = el("canvas", { id: "qkv-detail", width: N, height: N });
  big.style.width = big.style.height = Math.min(N, 640) + "px";
  const info = el("div", { className: "qkv-info", id: "qkv-info" });
  const steps = el("div", { className: "qkv-steps", id: "qkv-steps" });
  side.append(title, big, info, steps);

  const strip = el("div", { className: "qkv-tokens", id: "qkv-tokens" });
  const withLoss = frames.some((f) => f.losses);
  const lossTop = Math.max(1e-9, ...frames.flatMap((f) => f.losses || []).filter((v) => v));
  if (withLoss) strip.classList.add("with-loss");
  root.append(el("div", { className: "qkv-muted", textContent: "hover a token: its row " +
    "(where it attends) shades the tokens blue; what attends to it is underlined orange" +
    (withLoss ? "; under each token, its loss in nats (red: the model did not expect it)" : "") }),
    strip);
  const toks = D.tokens.map((t, i) => {
    // A long label is shortened in the strip; its whole text is the tooltip.
    const label = visible(t), short = shorten(t);
    const s = el("span", { className: "qkv-tok", textContent: short,
      title: short === label ? `position ${i}` : `position ${i}: ${label}` });
    s.dataset.i = i;
    strip.append(s);
    return s;
  });
  strip.addEventListener("mouseover", (e) => {
    const i = e.target.dataset && e.target.dataset.i;
    if (i !== undefined) hover(+i);
  });
  big.addEventListener("mousemove", (e) => {
    const r = big.getBoundingClientRect();
    const i = Math.floor((e.clientY - r.top) / r.height * T);
    if (i >= 0 && i < T) hover(i);
  });

  const base = (l, h) => ((l * H + h) * T) * K;
  function row(f, l, h, i) { // [key, weight] pairs of row i
    const out = [], o = base(l, h) + i * K;
    for (let j = 0; j < K; j++) if (f.weights[o + j] > 0) out.push([f.keys[o + j], f.weights[o + j] / 255]);
    return out;
  }
  function column(f, l, h, key) { // [query, weight] pairs that reach key
    const out = [], o = base(l, h);
    for (let i = 0; i < T; i++) for (let j = 0; j < K; j++) {
      const w = f.weights[o + i * K + j];
      if (w > 0 && f.keys[o + i * K + j] === key) out.push([i, w / 255]);
    }
    return out;
  }

  function drawThumbs() {
    const f = frames[state.frame];
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
      const { canvas, scores } = cells[l][h];
      const ctx = canvas.getContext("2d"), img = ctx.createImageData(S, S);
      const o = (l * H + h) * S * S;
      for (let p = 0; p < S * S; p++) {
        const c = shade(f.thumbs[o + p] / 255);
        img.data.set([c[0], c[1], c[2], 255], p * 4);
      }
      ctx.putImageData(img, 0, 0);
      const sc = (name) => (f.scores[name] ? f.scores[name][l][h] : null);
      const ind = sc("induction");
      scores.innerHTML = ind === null ? "" :
        `ind <b>${fmt(ind, 2)}</b> prev ${fmt(sc("previous_token"), 2)}<br>` +
        `dup ${fmt(sc("duplicate_token"), 2)} 1st ${fmt(sc("first_token"), 2)}`;
    }
  }

  function drawDetail() {
    const ctx = big.getContext("2d");
    ctx.fillStyle = "#fafafa"; ctx.fillRect(0, 0, N, N);
    if (state.layer === null) return;
    const f = frames[state.frame], l = state.layer, h = state.head, cell = N / T;
    const img = ctx.createImageData(N, N), acc = new Float32Array(N * N);
    const px = (x) => Math.min(N - 1, Math.floor(x * cell));
    for (let i = 0; i < T; i++) {
      const o = base(l, h) + i * K;
      for (let j = 0; j < K; j++) {
        const w = f.weights[o + j];
        if (!w) continue;
        const k = f.keys[o + j];
        for (let y = px(i); y < Math.max(px(i) + 1, px(i + 1)); y++)
          for (let x = px(k); x < Math.max(px(k) + 1, px(k + 1)); x++)
            acc[y * N + x] = Math.max(acc[y * N + x], w / 255);
      }
    }
    for (let p = 0; p < N * N; p++) {
      const c = shade(acc[p]);
      img.data.set([c[0], c[1], c[2], 255], p * 4);
    }
    ctx.putImageData(img, 0, 0);
    if (state.hover !== null) {
      ctx.strokeStyle = "rgba(220,50,50,0.8)";
      ctx.strokeRect(0, px(state.hover), N, Math.max(1, cell));
      ctx.strokeStyle = "rgba(240,140,0,0.8)";
      ctx.strokeRect(px(state.hover), 0, Math.max(1, cell), N);
    }
    api.draws += 1;
  }

  function drawLosses() {
    const losses = frames[state.frame].losses;
    if (!withLoss) return;
    toks.forEach((s, i) => {
      const v = losses ? losses[i] : null;
      s.dataset.loss = v === null || v === undefined ? "" : fmt(v, 1);
      // red in proportion to the loss, full at the largest loss of any frame
      s.style.setProperty("--loss", v ? `rgba(210,40,40,${Math.min(1, v / lossTop)})` : "transparent");
    });
  }

  function drawTokens() {
    toks.forEach((s) => { s.style.background = ""; s.style.removeProperty("--from"); s.classList.remove("hovered"); });
    info.textContent = "";
    if (state.hover === null) return;
    toks[state.hover].classList.add("hovered");
    if (state.layer === null) return;
    const f = frames[state.frame], to = row(f, state.layer, state.head, state.hover);
    const from = column(f, state.layer, state.head, state.hover);
    to.forEach(([k, w]) => { const c = shade(w); toks[k].style.background = `rgb(${c})`; });
    from.forEach(([q, w]) => toks[q].style.setProperty("--from", `rgba(240,140,0,${0.2 + 0.8 * w})`));
    const top = (pairs) => pairs.sort((a, b) => b[1] - a[1]).slice(0, 5)
      .map(([i, w]) => `<bdi>${lab(D.tokens[i])}</bdi>@${i} ${fmt(w, 2)}`).join(", ") || "—";
    info.innerHTML = `<b><bdi>${lab(D.tokens[state.hover])}</bdi>@${state.hover}</b> attends to: ${top(to)}` +
      `<br>attended by: ${top(from)}`;
  }

  function drawSteps() {
    steps.textContent = "";
    if (state.layer === null) return;
    const s = frames[state.frame].steps[state.layer][state.head], q = D.query;
    const rows = s.keys.map((k, n) => `<tr><td><bdi>${lab(D.tokens[k])}</bdi>@${k}</td><td>${fmt(s.qk[n])}</td>` +
      `<td>${fmt(s.scaled[n])}</td>${s.modified ? `<td>${fmt(s.modified[n])}</td>` : ""}` +
      `<td>${s.allowed[n] ? "✓" : "masked"}</td><td>${fmt(s.weights[n])}</td></tr>`).join("");
    steps.innerHTML = `<b>query <bdi>${lab(D.tokens[q])}</bdi>@${q}, step by step</b> (d = ${s.d}; ` +
      `${s.masked} keys masked)<br>q = [${s.q.map((x) => fmt(x, 2)).join(", ")}${s.d > 8 ? ", …" : ""}]` +
      `<table><tr><th>key</th><th>q·k</th><th>× ${fmt(s.scale, 4)}</th>` +
      `${s.modified ? "<th>modified</th>" : ""}<th>mask</th><th>softmax</th></tr>${rows}</table>` +
      `out = weights · V = [${s.out.map((x) => fmt(x, 2)).join(", ")}${s.d_v > 8 ? ", …" : ""}]`;
  }

  function select(l, h) {
    if (state.layer !== null) cells[state.layer][state.head].cell.classList.remove("selected");
    state.layer = l; state.head = h;
    cells[l][h].cell.classList.add("selected");
    title.textContent = `layer ${l}, head ${h} — rows: queries, columns: keys`;
    drawDetail(); drawTokens(); drawSteps();
  }
  function hover(i) {
    if (state.hover === i) return;
    state.hover = i;
    drawDetail(); drawTokens();
  }
  function redraw() {
    frameLabel.textContent = frames[state.frame].label;
    drawThumbs(); drawDetail(); drawLosses(); drawTokens(); drawSteps();
  }
  api.select = select; api.hover = hover; api.redraw = redraw;
  redraw();
  if (D.opened) select(D.opened[0], D.opened[1]);  // the strongest induction head, by default
  api.ready = true;
})();
