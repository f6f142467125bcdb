// kvlb console: plain JavaScript, no build step, no libraries. Every value from the server is put
// in the page with textContent or as an SVG attribute, never parsed as HTML. The admin token lives
// in sessionStorage (this tab only) and travels only in the Authorization header of same-origin
// fetch calls made with credentials "omit": no cookie, never in a URL.
"use strict";

(function () {
  const TOKEN_KEY = "kvlb.adminToken";
  const ACTOR_KEY = "kvlb.actor";
  const FLEET_EVERY_MS = 2000;
  const DECISIONS_EVERY_MS = 2000;
  const SERIES_EVERY_MS = 5000;
  const AUDIT_EVERY_MS = 10000;
  const POLICY_EVERY_MS = 10000;
  const WHATIF_DEBOUNCE_MS = 400;
  const DASH = "—";

  const $ = (id) => document.getElementById(id);
  const state = {
    token: null,
    session: 0,
    timers: [],
    policy: null,
    pools: [],
    replicas: [],
    replicaPools: {},
    selectedDecision: null,
    whatifTimer: null,
    whatifSeq: 0,
    proposal: null,
  };

  // ------------------------------------------------------------------ DOM helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else if (key === "title") node.title = value;
      else if (key === "onclick") node.addEventListener("click", value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, String(value));
    }
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function fmtNumber(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return DASH;
    if (typeof value !== "number") return String(value);
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    return String(Number(value.toFixed(digits === undefined ? 2 : digits)));
  }

  function fmtPercent(value) {
    return value === null || value === undefined ? DASH : (100 * value).toFixed(1) + " %";
  }

  function fmtSeconds(value) {
    if (value === null || value === undefined) return DASH;
    return value < 1 ? (1000 * value).toFixed(0) + " ms" : value.toFixed(2) + " s";
  }

  function fmtTime(ts) {
    if (typeof ts !== "number") return DASH;
    return new Date(ts * 1000).toLocaleTimeString("en-GB", { hour12: false });
  }

  function fmtDateTime(ts) {
    if (typeof ts !== "number") return DASH;
    const d = new Date(ts * 1000);
    return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  }

  function setText(id, text) {
    $(id).textContent = text;
  }

  // ------------------------------------------------------------------ the admin API

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(method, path, body, extraHeaders) {
    const headers = { Accept: "application/json", Authorization: "Bearer " + state.token };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    Object.assign(headers, extraHeaders || {});
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
      referrerPolicy: "no-referrer",
      redirect: "error",
    });
    let payload = null;
    try {
      payload = await response.json();
    } catch (err) {
      payload = null;
    }
    if (response.status === 401) {
      logout("The token was refused (401): enter the admin token again.");
      throw new ApiError(401, "unauthorized");
    }
    if (!response.ok) {
      const message = payload && payload.error && payload.error.message ? payload.error.message : response.statusText;
      throw new ApiError(response.status, message);
    }
    return payload;
  }

  // ------------------------------------------------------------------ login

  async function login(token) {
    state.token = token;
    try {
      await api("GET", "/admin/policy");
    } catch (err) {
      state.token = null;
      if (err.status === 403) $("login-error").textContent = "That key is not the admin token: " + err.message;
      else if (err.status !== 401) $("login-error").textContent = "Could not reach the admin API: " + err.message;
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    $("login").hidden = true;
    $("console").hidden = false;
    $("logout").hidden = false;
    setText("status", "connected to " + location.host);
    start();
  }

  function logout(message) {
    state.session += 1;
    for (const timer of state.timers) clearTimeout(timer);
    state.timers = [];
    state.token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    $("console").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("token").value = "";
    $("login-error").textContent = message || "";
    setText("status", "not logged in");
  }

  // A poller runs fn every `every` ms, one call at a time, until the session it was started in ends
  // (log out, or a 401); errors are shown by fn, never thrown.
  function poll(fn, every) {
    const session = state.session;
    const run = async () => {
      if (session !== state.session || state.token === null) return;
      try {
        await fn();
      } catch (err) {
        if (err.status === 401) return;
      }
      if (session !== state.session) return;
      const timer = setTimeout(run, every);
      state.timers.push(timer);
      if (state.timers.length > 64) state.timers = state.timers.slice(-16);
    };
    run();
  }

  function start() {
    state.session += 1;
    poll(refreshFleet, FLEET_EVERY_MS);
    poll(refreshPolicy, POLICY_EVERY_MS);
    poll(refreshSeries, SERIES_EVERY_MS);
    poll(refreshAudit, AUDIT_EVERY_MS);
    poll(refreshDecisions, DECISIONS_EVERY_MS);
  }

  // ------------------------------------------------------------------ fleet

  function healthOf(view) {
    const health = view.health || {};
    if (health.draining) return [health.drain ? "draining (" + health.drain.by + ")" : "draining", "warn"];
    if (view.routable) return ["healthy", "ok"];
    if (health.breaker && health.breaker !== "closed") return ["breaker " + health.breaker, "bad"];
    if (health.probe_ok === false) return ["probe failing", "bad"];
    if (health.key_refused) return ["key refused", "bad"];
    if (health.model_mismatch) return ["wrong model", "bad"];
    return ["not routable", "bad"];
  }

  // The health cell's tooltip: who drained the replica, when and why; else the last error.
  function healthTitle(health) {
    if (!health) return "";
    const drain = health.drain;
    if (health.draining && drain) {
      const when = typeof drain.at_wall_ts === "number" ? " at " + fmtDateTime(drain.at_wall_ts) : "";
      return "drained by " + drain.by + " (" + drain.caller + ")" + when + ": " + (drain.reason || "no reason given");
    }
    return health.key_refused || health.model_mismatch || health.last_error || "";
  }

  // Prediction accuracy, when kvlb reports it: /admin/replicas' "prediction" (the engines' receipts
  // of cached blocks vs what the router predicted) as {receipts, accuracy, within_one_block,
  // mean_error_blocks}; "—" when absent or not measured yet.
  function accuracyOf(view) {
    const p = view.prediction;
    if (!p || typeof p.accuracy !== "number") return [DASH, ""];
    const details = [fmtNumber(p.receipts) + " receipts"];
    if (typeof p.within_one_block === "number") details.push(fmtPercent(p.within_one_block) + " within one block");
    if (typeof p.mean_error_blocks === "number") details.push("mean error " + fmtNumber(p.mean_error_blocks) + " blocks");
    return [fmtPercent(p.accuracy), details.join(", ")];
  }

  // The replica's KV event streams (/admin/replicas' "events".sources): "ok", or what is wrong with
  // the newest problem in the title (a block size other than the engine's, an endpoint nothing or no
  // publisher answers on: each source's last_error names the fix), or "silent" with events.hint (the
  // engine answered requests but published nothing: prefix cache off, another topic). A problem older than
  // EVENT_PROBLEM_S shows as "ok" again, with the old problem still in the title.
  const EVENT_PROBLEM_S = 300;
  const CLOCK_AHEAD_S = 1.0; // balancer/sources/pipeline.py CLOCK_AHEAD_S
  function eventsOf(view) {
    const events = view.events;
    if (!events || !Array.isArray(events.sources) || events.sources.length === 0) return [DASH, "", "no event source"];
    const notes = [];
    let word = "ok";
    let cls = "ok";
    for (const source of events.sources) {
      const where = source.endpoint + (typeof source.dp_rank === "number" ? " (rank " + source.dp_rank + ")" : "");
      if (source.last_error) {
        const age = typeof source.last_error_age_s === "number" ? source.last_error_age_s : null;
        notes.push(where + ": " + source.last_error + (age === null ? "" : " (" + fmtSeconds(age) + " ago)"));
        if (age !== null && age < EVENT_PROBLEM_S && word === "ok") {
          word = "error";
          cls = "bad";
        }
      }
      if (source.connected === false) {
        word = "not connected";
        cls = "bad";
      }
    }
    if (events.hint && word === "ok") {
      word = "silent";
      cls = "warn";
      notes.push(events.hint);
    }
    return [word, cls, notes.length ? notes.join("\n") : "every stream connected, no problem seen"];
  }

  async function refreshFleet() {
    const [replicas, fleet] = await Promise.all([api("GET", "/admin/replicas"), api("GET", "/admin/fleet")]);
    const views = replicas.replicas || [];
    state.replicas = views.map((v) => v.id);
    state.replicaPools = Object.fromEntries(views.map((v) => [v.id, v.model]));
    const pools = [...new Set(views.map((v) => v.model))];
    state.pools = pools;
    fillSelect($("filter-pool"), pools, true);
    fillSelect($("filter-replica"), state.replicas, true);
    fillSelect($("whatif-pool"), pools, false);

    const body = $("fleet-table").tBodies[0];
    clear(body);
    for (const view of views) {
      const [healthText, healthClass] = healthOf(view);
      const load = view.load || {};
      const events = view.events;
      const lag = events && typeof events.last_lag_s === "number" ? fmtSeconds(Math.max(0, events.last_lag_s)) : DASH;
      let lastEvent = events && typeof events.last_applied_age_s === "number" ? "last event applied " + fmtSeconds(events.last_applied_age_s) + " ago" : "no event applied yet";
      // a batch stamped in kvlb's future: the engine's clock is ahead, and the lag reads low by as much
      const ahead = events && typeof events.last_lag_s === "number" && events.last_lag_s < -CLOCK_AHEAD_S;
      if (ahead) lastEvent += "; the engine's clock is " + fmtSeconds(-events.last_lag_s) + " ahead of kvlb's: the lag reads low by as much (sync the clocks)";
      body.append(
        el(
          "tr",
          { "data-replica": view.id, "data-pool": view.model },
          el("td", { text: view.model }),
          el("td", { text: view.id, title: view.url }),
          el("td", { text: view.engine }),
          el("td", { class: healthClass, text: healthText, title: healthTitle(view.health) }),
          el("td", { class: "num", text: fmtNumber(view.inflight) }),
          el("td", { class: "num", text: fmtNumber(load.pending_prefill_tokens) }),
          el("td", { class: "num", text: fmtNumber(load.active_decode_blocks) }),
          el("td", { class: "num", text: fmtNumber(load.waiting_reqs) }),
          el("td", { class: "num", text: typeof load.kv_usage === "number" ? fmtPercent(load.kv_usage) : DASH }),
          el("td", { class: "num", text: fmtNumber(view.index ? view.index.blocks : null) }),
          el("td", { class: ahead ? "num warn" : "num", text: ahead ? "clock ahead" : lag, title: lastEvent }),
          el("td", { class: "num", text: events ? fmtNumber(events.queued_batches) : DASH }),
          el("td", { class: "num", text: accuracyOf(view)[0], title: accuracyOf(view)[1] }),
          el("td", { class: eventsOf(view)[1], text: eventsOf(view)[0], title: eventsOf(view)[2] })
        )
      );
    }
    const healthy = views.filter((v) => v.routable).length;
    const perPool = pools
      .map((p) => {
        const members = views.filter((v) => v.model === p);
        return p + ": " + members.filter((v) => v.routable).length + "/" + members.length + " routable";
      })
      .join(" · ");
    let meta = views.length + " replicas, " + healthy + " routable · " + perPool;
    const info = fleet.fleet;
    if (info === null || info === undefined) meta += " · embedded index (no Redis fleet)";
    else if (Array.isArray(info.members)) meta += " · Redis fleet of " + info.members.length + " balancers";
    else meta += " · Redis fleet";
    const kept = replicas.kept_drains || [];
    if (kept.length) meta += " · " + (replicas.kept_drains_total || kept.length) + " drains kept for removed replicas";
    setText("fleet-meta", meta);
    // the drains kept for replicas discovery removed: each comes back drained if added again in time
    const keptList = $("fleet-kept-drains");
    clear(keptList);
    for (const entry of kept) {
      const left = typeof entry.expires_in_s === "number" ? "; forgotten in " + fmtSeconds(Math.max(0, entry.expires_in_s)) + " unless added again" : "";
      keptList.append(el("li", { "data-replica": entry.id, text: entry.id + " (removed): " + entry.text + left }));
    }
    setText("fleet-updated", "updated " + new Date().toLocaleTimeString("en-GB", { hour12: false }));
  }

  function fillSelect(select, values, withAll) {
    const current = select.value;
    const wanted = (withAll ? [""] : []).concat(values);
    const have = [...select.options].map((o) => o.value);
    if (have.length === wanted.length && have.every((v, i) => v === wanted[i])) return;
    clear(select);
    for (const value of wanted) select.append(el("option", { value, text: value === "" ? "all" : value }));
    if (wanted.includes(current)) select.value = current;
  }

  // ------------------------------------------------------------------ policy and what-if

  function rangeText(range) {
    if (!range) return DASH;
    // as WeightRange prints it (and an SRE would type it): [0, 1000], no thousands separators
    const low = (range.low_open ? "(" : "[") + String(range.low);
    return low + ", " + String(range.high) + "]" + (range.nullable ? " or empty (off)" : "");
  }

  async function refreshPolicy() {
    const policy = await api("GET", "/admin/policy");
    const first = state.policy === null;
    const changedVersion = !first && state.policy.version !== policy.version;
    const previous = state.policy;
    state.policy = policy;
    setText("policy-version", "v" + policy.version + " by " + policy.updated_by + " at " + fmtDateTime(policy.updated_at));
    const names = policy.policies || [policy.name];
    fillSelect($("policy-name"), names, false);
    if (first || (changedVersion && !state.proposal)) {
      $("policy-name").value = policy.name;
      buildWeights(policy);
    } else {
      if (changedVersion) {
        // the weights this SRE did not touch follow the new version (else Apply would revert them)
        for (const input of document.querySelectorAll("#weights-table input[data-weight]")) {
          const name = input.dataset.weight;
          const old = previous.weights[name];
          if (input.value.trim() === (old === null ? "" : String(old))) {
            const now = policy.weights[name];
            input.value = now === null ? "" : String(now);
          }
        }
        $("apply-result").className = "warn";
        setText("apply-result", "The policy changed to v" + policy.version + " (by " + policy.updated_by + ") while you were editing: your proposal is now compared with it.");
        onProposalInput();
      }
      for (const [name, value] of Object.entries(policy.weights)) {
        const cell = document.querySelector('#weights-table tr[data-weight="' + name + '"] td.current');
        if (cell) cell.textContent = value === null ? "off" : fmtNumber(value, 4);
      }
    }
  }

  function buildWeights(policy) {
    const body = $("weights-table").tBodies[0];
    clear(body);
    const ranges = policy.ranges || {};
    for (const [name, value] of Object.entries(policy.weights)) {
      const input = el("input", { id: "w-" + name, type: "text", inputmode: "decimal", "data-weight": name });
      input.value = value === null ? "" : String(value);
      input.addEventListener("input", onProposalInput);
      body.append(
        el(
          "tr",
          { "data-weight": name },
          el("td", { text: name }),
          el("td", { class: "num current", text: value === null ? "off" : fmtNumber(value, 4) }),
          el("td", {}, input),
          el("td", { class: "muted", text: rangeText(ranges[name]) })
        )
      );
    }
    state.proposal = null;
    showNoProposal();
  }

  // The proposal: {weights: changed ones, name: policy name or undefined} or null when invalid/empty.
  function readProposal() {
    const policy = state.policy;
    const ranges = policy.ranges || {};
    const weights = {};
    let valid = true;
    for (const input of document.querySelectorAll("#weights-table input[data-weight]")) {
      const name = input.dataset.weight;
      const range = ranges[name];
      const text = input.value.trim();
      let value;
      let ok = true;
      if (text === "") {
        value = null;
        ok = !range || range.nullable;
      } else {
        value = Number(text);
        ok = Number.isFinite(value) && /^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(text);
        if (ok && range) ok = (range.low_open ? value > range.low : value >= range.low) && value <= range.high;
      }
      input.classList.toggle("invalid", !ok);
      input.closest("tr").classList.toggle("changed", ok && value !== policy.weights[name]);
      if (!ok) valid = false;
      else if (value !== policy.weights[name]) weights[name] = value;
    }
    const name = $("policy-name").value;
    const proposal = { weights };
    if (name && name !== policy.name) proposal.name = name;
    if (!valid) return { invalid: true };
    if (Object.keys(weights).length === 0 && proposal.name === undefined) return null;
    return proposal;
  }

  function onProposalInput() {
    clearTimeout(state.whatifTimer);
    const proposal = readProposal();
    state.proposal = proposal && !proposal.invalid ? proposal : null;
    updateApply();
    if (proposal === null) {
      showNoProposal();
      return;
    }
    if (proposal.invalid) {
      setText("whatif-state", "(a value is outside its range)");
      return;
    }
    setText("whatif-state", "(running…)");
    state.whatifTimer = setTimeout(() => runWhatif(proposal), WHATIF_DEBOUNCE_MS);
  }

  function showNoProposal() {
    setText("whatif-state", "(change a weight)");
    setText("whatif-error", "");
    clear($("whatif-result"));
    updateApply();
  }

  function updateApply() {
    $("apply").disabled = !(state.proposal && $("reason").value.trim().length > 0);
  }

  async function runWhatif(proposal) {
    const seq = ++state.whatifSeq;
    const body = {
      pool: $("whatif-pool").value || state.pools[0],
      weights: proposal.weights,
      policy: proposal.name || state.policy.name,
      sample: 5,
    };
    let result;
    try {
      result = await api("POST", "/admin/whatif", body);
    } catch (err) {
      if (seq !== state.whatifSeq) return;
      setText("whatif-state", "");
      setText("whatif-error", err.status === 404 ? "what-if is not available on this kvlb (" + err.message + ")" : err.message);
      clear($("whatif-result"));
      return;
    }
    if (seq !== state.whatifSeq) return; // a newer proposal is on its way
    setText("whatif-error", "");
    setText("whatif-state", "(" + fmtNumber(result.decisions) + " recent decisions replayed)");
    renderWhatif(result);
  }

  function renderWhatif(result) {
    const target = $("whatif-result");
    clear(target);
    const before = result.before || {};
    const after = result.after || {};
    const delta = (b, a, percent) => {
      if (typeof b !== "number" || typeof a !== "number") return "";
      const d = a - b;
      return (d >= 0 ? "+" : "") + (percent ? (100 * d).toFixed(1) + " pt" : fmtNumber(Number(d.toFixed(3))));
    };
    const summary = el(
      "table",
      { id: "whatif-summary" },
      el("thead", {}, el("tr", {}, el("th", { text: "" }), el("th", { text: "before" }), el("th", { text: "after" }), el("th", { text: "change" }))),
      el(
        "tbody",
        {},
        el("tr", { "data-figure": "changed_share" }, el("td", { text: "decisions that change" }), el("td", { class: "num", text: fmtNumber(result.changed) + " of " + fmtNumber(result.decisions) }), el("td", { class: "num", text: fmtPercent(result.changed_share) }), el("td", { text: "" })),
        el("tr", { "data-figure": "hit_rate" }, el("td", { text: "hit rate" }), el("td", { class: "num", text: fmtPercent(before.hit_rate) }), el("td", { class: "num", text: fmtPercent(after.hit_rate) }), el("td", { class: "num", text: delta(before.hit_rate, after.hit_rate, true) })),
        el("tr", { "data-figure": "predicted_cached_tokens" }, el("td", { text: "predicted cached tokens" }), el("td", { class: "num", text: fmtNumber(before.predicted_cached_tokens) }), el("td", { class: "num", text: fmtNumber(after.predicted_cached_tokens) }), el("td", { class: "num", text: delta(before.predicted_cached_tokens, after.predicted_cached_tokens, false) })),
        el("tr", { "data-figure": "load_spread" }, el("td", { text: "load spread (max ÷ mean)" }), el("td", { class: "num", text: fmtNumber(before.load_spread) }), el("td", { class: "num", text: fmtNumber(after.load_spread) }), el("td", { class: "num", text: delta(before.load_spread, after.load_spread, false) }))
      )
    );
    target.append(summary);
    const replicas = result.replicas || [];
    if (replicas.length) {
      const rows = replicas.map((r) =>
        el(
          "tr",
          { "data-replica": r.replica },
          el("td", { text: r.replica }),
          el("td", { class: "num", text: fmtPercent(r.before_share) }),
          el("td", { class: "num", text: fmtPercent(r.after_share) }),
          el("td", { class: "num " + (r.delta_share > 0 ? "delta-up" : r.delta_share < 0 ? "delta-down" : ""), text: (r.delta_share > 0 ? "+" : "") + (100 * r.delta_share).toFixed(1) + " pt" })
        )
      );
      target.append(
        el("h3", { text: "Traffic share per replica" }),
        el("table", { id: "whatif-replicas" }, el("thead", {}, el("tr", {}, el("th", { text: "replica" }), el("th", { text: "before" }), el("th", { text: "after" }), el("th", { text: "change" }))), el("tbody", {}, ...rows))
      );
    }
    const sample = result.sample || [];
    if (sample.length) {
      const list = el("ul", { id: "whatif-sample" });
      for (const item of sample.slice(0, 5)) {
        const b = item.before || {};
        const a = item.after || {};
        list.append(el("li", {}, "decision " + item.id + " at " + fmtTime(item.ts) + ": " + b.replica + " → " + a.replica + " (after: " + termsText(termsByReplica(a)[a.replica]) + ")"));
      }
      target.append(el("h3", { text: "Changed decisions (sample)" }), list);
    }
    const notes = result.notes || [];
    if (notes.length) {
      const list = el("ul", { class: "muted" });
      for (const note of notes) list.append(el("li", { text: note }));
      target.append(list);
    }
  }

  async function applyProposal() {
    const proposal = state.proposal;
    const reason = $("reason").value.trim();
    if (!proposal || !reason) return;
    const actor = $("actor").value.trim();
    sessionStorage.setItem(ACTOR_KEY, actor);
    const body = { weights: proposal.weights, reason };
    if (proposal.name) body.name = proposal.name;
    $("apply").disabled = true;
    try {
      const result = await api("PUT", "/admin/policy", body, actor ? { "x-kvlb-actor": actor } : {});
      const changed = Object.keys(result.changed || {});
      $("apply-result").className = "ok";
      setText("apply-result", "Applied: policy v" + result.version + (changed.length ? " (" + changed.join(", ") + ")" : " (nothing changed)"));
      $("reason").value = "";
      state.policy = null;
      await refreshPolicy();
      await refreshAudit();
    } catch (err) {
      $("apply-result").className = "error";
      setText("apply-result", "Not applied: " + err.message);
      updateApply();
    }
  }

  // ------------------------------------------------------------------ audit

  function changeText(change) {
    if (!change) return DASH;
    const before = change.before || {};
    const after = change.after || {};
    const parts = [];
    const flat = (obj) => {
      const out = {};
      for (const [k, v] of Object.entries(obj)) {
        if (v && typeof v === "object" && !Array.isArray(v)) for (const [k2, v2] of Object.entries(v)) out[k2] = v2;
        else out[k] = v;
      }
      return out;
    };
    const b = flat(before);
    const a = flat(after);
    for (const key of new Set([...Object.keys(b), ...Object.keys(a)])) {
      if (JSON.stringify(b[key]) !== JSON.stringify(a[key])) parts.push(key + ": " + JSON.stringify(b[key]) + " → " + JSON.stringify(a[key]));
    }
    return parts.length ? parts.join(", ") : "no change";
  }

  async function refreshAudit() {
    let audit;
    try {
      audit = await api("GET", "/admin/audit?limit=50");
    } catch (err) {
      if (err.status !== 401) setText("audit-error", err.status === 404 ? "the audit log is not available on this kvlb" : err.message);
      throw err;
    }
    setText("audit-error", "");
    const body = $("audit-table").tBodies[0];
    clear(body);
    for (const entry of audit.entries || []) {
      body.append(
        el(
          "tr",
          {},
          el("td", { text: fmtDateTime(entry.ts) }),
          el("td", { text: entry.actor || DASH, title: entry.caller ? "caller " + entry.caller + (entry.version ? ", version " + entry.version : "") : "" }),
          el("td", { class: "wrap", text: changeText(entry.change) }),
          el("td", { class: "wrap reason", text: entry.reason || DASH })
        )
      );
    }
  }

  // ------------------------------------------------------------------ decisions

  // The cost terms the feed and the explanation show, in this order (others are left out).
  const TERM_COLUMNS = [
    ["cost", "cost"],
    ["overlap_blocks", "overlap"],
    ["prefill_term", "prefill"],
    ["duplication_term", "duplication"],
    ["decode_term", "decode"],
    ["queue_term", "queue"],
    ["root_term", "held roots charge"],
    ["held_roots", "held roots"],
    ["pending_prefill_blocks", "pending prefill blocks"],
    ["active_decode_blocks", "decode blocks"],
    ["waiting_requests", "waiting"],
    ["kv_usage", "KV usage"],
    ["probability", "probability"],
    ["excluded", "excluded"],
  ];
  // Shown only when some replica has a non-zero value (the held-roots charge applies only to prompts
  // no replica holds any of, and not at all with root_weight 0).
  const ZERO_HIDDEN_TERMS = new Set(["root_term"]);

  function termsText(terms) {
    if (!terms) return DASH;
    const parts = [];
    for (const [key, label] of TERM_COLUMNS.slice(0, 6)) {
      const value = terms[key];
      if (value === null || value === undefined) continue;
      if (key === "overlap_blocks" && typeof terms.request_blocks === "number") parts.push(label + " " + value + "/" + terms.request_blocks);
      else parts.push(label + " " + fmtNumber(value));
    }
    return parts.length ? parts.join(" · ") : DASH;
  }

  // {replica: {term: value}} from either shape: the feed's map or /admin/decisions/{id}'s list.
  function termsByReplica(d) {
    if (d.terms && !Array.isArray(d.terms)) return d.terms;
    const list = (d.decision && d.decision.terms) || d.terms || [];
    const out = {};
    for (const t of list) out[t.replica] = t;
    return out;
  }

  async function refreshDecisions() {
    if ($("decisions-pause").checked) return;
    const params = new URLSearchParams({ limit: "50" });
    for (const [key, id] of [["pool", "filter-pool"], ["replica", "filter-replica"], ["tenant", "filter-tenant"]]) {
      const value = $(id).value.trim();
      if (value) params.set(key, value);
    }
    let result;
    try {
      result = await api("GET", "/admin/decisions?" + params.toString());
    } catch (err) {
      if (err.status !== 401) setText("decisions-error", err.status === 404 ? "the decision feed is not available on this kvlb" : err.message);
      throw err;
    }
    setText("decisions-error", "");
    const body = $("decisions-table").tBodies[0];
    clear(body);
    for (const d of result.decisions || []) {
      const row = el(
        "tr",
        { class: "clickable" + (String(d.id) === state.selectedDecision ? " selected" : ""), "data-id": String(d.id) },
        el("td", { text: fmtTime(d.ts) }),
        el("td", { text: d.pool }),
        el("td", { text: d.tenant || DASH }),
        el("td", { text: d.replica }),
        el("td", { class: "num", text: fmtNumber(d.prefill_tokens) }),
        el("td", { class: "num", text: fmtNumber(d.predicted_cached_tokens) }),
        el("td", { class: "wrap", text: termsText(termsByReplica(d)[d.replica]) })
      );
      row.addEventListener("click", () => explain(String(d.id)));
      body.append(row);
    }
    // kvlb serve --workers N: the answer is every worker's; name those that did not answer in time
    const missing = result.workers_missing || [];
    const workers = result.workers ? " from " + result.workers.length + " workers" + (missing.length ? " (worker " + missing.join(", ") + " did not answer)" : "") : "";
    setText("decisions-updated", (result.decisions || []).length + " shown" + workers + ", updated " + new Date().toLocaleTimeString("en-GB", { hour12: false }));
  }

  async function explain(id) {
    state.selectedDecision = id;
    for (const row of document.querySelectorAll("#decisions-table tr.selected")) row.classList.remove("selected");
    const row = document.querySelector('#decisions-table tr[data-id="' + CSS.escape(id) + '"]');
    if (row) row.classList.add("selected");
    const target = $("explanation");
    clear(target);
    target.append(el("p", { class: "muted", text: "loading decision " + id + "…" }));
    let d;
    try {
      d = await api("GET", "/admin/decisions/" + encodeURIComponent(id));
    } catch (err) {
      clear(target);
      target.append(el("p", { class: "error", text: err.message }));
      return;
    }
    clear(target);
    const decision = d.decision || {};
    const chosen = d.replica || decision.replica;
    const prompt = d.prefill_tokens !== undefined ? d.prefill_tokens : d.prompt_tokens;
    const cached = d.predicted_cached_tokens !== undefined ? d.predicted_cached_tokens : d.cached_tokens;
    target.append(el("h3", { text: "Decision " + d.id + " → " + chosen }));
    target.append(
      el("p", { class: "muted", text: fmtDateTime(d.ts) + " · pool " + d.pool + " · tenant " + (d.tenant || DASH) + " · policy " + (decision.policy || d.policy || DASH) + (d.request_id ? " · request " + d.request_id : "") })
    );
    const why = decision.reason || d.reason || (typeof d.explanation === "string" ? d.explanation : "");
    target.append(
      el(
        "p",
        { id: "explanation-text" },
        (why ? "Why: " + why + ". " : "") + fmtNumber(cached) + " of " + fmtNumber(prompt) + " prompt tokens predicted cached on " + chosen + "."
      )
    );
    const terms = termsByReplica(d);
    const columns = TERM_COLUMNS.filter(([key]) => Object.values(terms).some((t) => t && t[key] !== undefined && t[key] !== null && t[key] !== "" && !(ZERO_HIDDEN_TERMS.has(key) && t[key] === 0)));
    if (Object.keys(terms).length) {
      const head = el("tr", {}, el("th", { text: "replica" }), ...columns.map(([, label]) => el("th", { text: label })));
      const rows = Object.entries(terms).map(([replica, t]) =>
        el(
          "tr",
          { class: replica === chosen ? "selected" : "", "data-replica": replica },
          el("td", { text: replica + (replica === chosen ? " ✓" : "") }),
          ...columns.map(([key]) => {
            const v = t ? t[key] : null;
            const text = key === "overlap_blocks" && t && typeof t.request_blocks === "number" ? v + "/" + t.request_blocks : key === "kv_usage" && typeof v === "number" ? fmtPercent(v) : fmtNumber(v);
            return el("td", { class: "num", text });
          })
        )
      );
      target.append(el("div", { class: "scroll" }, el("table", { id: "explanation-terms" }, el("thead", {}, head), el("tbody", {}, ...rows))));
      target.append(el("p", { class: "muted", text: "cost = prefill + duplication + interference + admission + held roots charge + decode + queue, in blocks; the lowest cost wins (docs/policies.md)." }));
    }
    // the pool's replicas the policy did not score, and why (the record keeps why since 2026-12-01;
    // an older balancer's record names them by the pool's present replicas, without a reason)
    if (d.left_out && typeof d.left_out === "object" && Object.keys(d.left_out).length) {
      const why = Object.entries(d.left_out).map(([replica, reason]) => replica + " (" + reason + ")");
      target.append(el("p", { id: "explanation-left-out", text: "Not candidates when it was decided: " + why.join(", ") + "." }));
    } else if (!d.left_out) {
      const candidates = d.inputs && Array.isArray(d.inputs.candidates) ? new Set(d.inputs.candidates) : null;
      const leftOut = candidates
        ? Object.entries(state.replicaPools)
            .filter(([replica, pool]) => pool === d.pool && !candidates.has(replica))
            .map(([replica]) => replica)
        : [];
      if (leftOut.length) {
        target.append(
          el("p", { id: "explanation-left-out", text: "Not candidates (drained, down or full when it was decided, or added since): " + leftOut.join(", ") + "." })
        );
      }
    }
    if (d.weights) {
      const weights = Object.entries(d.weights).filter(([, v]) => v !== null).map(([k, v]) => k + "=" + fmtNumber(v, 4)).join(", ");
      target.append(el("p", { class: "muted", text: "weights: " + weights }));
    }
  }

  // ------------------------------------------------------------------ plots (plain SVG)

  const PLOT = { w: 420, h: 180, left: 44, right: 8, top: 8, bottom: 22 };

  function frame(svg, maxY, fmtY, t0, t1) {
    clear(svg);
    const { w, h, left, right, top, bottom } = PLOT;
    svg.append(svgEl("line", { class: "axis", x1: left, y1: h - bottom, x2: w - right, y2: h - bottom }));
    svg.append(svgEl("line", { class: "axis", x1: left, y1: top, x2: left, y2: h - bottom }));
    for (const f of [0, 0.5, 1]) {
      const y = h - bottom - f * (h - top - bottom);
      svg.append(svgEl("text", { x: left - 4, y: y + 3, "text-anchor": "end", text: fmtY(f * maxY) }));
      if (f > 0) svg.append(svgEl("line", { class: "axis", x1: left, y1: y, x2: w - right, y2: y, "stroke-dasharray": "2 3" }));
    }
    svg.append(svgEl("text", { x: left, y: h - 6, text: fmtTime(t0) }));
    svg.append(svgEl("text", { x: w - right, y: h - 6, "text-anchor": "end", text: fmtTime(t1) }));
    const x = (t) => left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (w - left - right);
    const y = (v) => h - bottom - (v / Math.max(1e-12, maxY)) * (h - top - bottom);
    return { x, y };
  }

  function drawLines(svg, legend, rows, lines, maxY, fmtY, interval) {
    const t0 = rows.length ? rows[0].ts : 0;
    const t1 = rows.length ? rows[rows.length - 1].ts + interval : 1;
    const { x, y } = frame(svg, maxY, fmtY, t0, t1);
    clear(legend);
    lines.forEach((line, i) => {
      let d = "";
      let pen = false;
      for (const row of rows) {
        const v = row[line.key];
        if (typeof v !== "number") {
          pen = false;
          continue;
        }
        d += (pen ? "L" : "M") + x(row.ts + interval / 2).toFixed(1) + " " + y(Math.min(v, maxY)).toFixed(1) + " ";
        pen = true;
      }
      if (d) svg.append(svgEl("path", { class: "line s" + i, d }));
      for (const row of rows) {
        const v = row[line.key];
        // data-ts and data-value: the interval and the figure as the answer gave them (a hover tool or a test reads them)
        if (typeof v === "number") svg.append(svgEl("circle", { class: "s" + i, cx: x(row.ts + interval / 2).toFixed(1), cy: y(Math.min(v, maxY)).toFixed(1), r: 1.6, "data-ts": row.ts, "data-value": v }));
      }
      legend.append(el("span", { class: "s" + i, text: line.label }));
    });
  }

  function drawShare(svg, legend, rows, replicas, interval) {
    const t0 = rows.length ? rows[0].ts : 0;
    const t1 = rows.length ? rows[rows.length - 1].ts + interval : 1;
    const { x, y } = frame(svg, 1, (v) => (100 * v).toFixed(0) + "%", t0, t1);
    const width = Math.max(1, x(t0 + interval) - x(t0) - 1);
    for (const row of rows) {
      if (!row.requests) continue;
      let base = 0;
      replicas.forEach((replica, i) => {
        const share = (row.replicas[replica] || 0) / row.requests;
        if (share <= 0) return;
        svg.append(svgEl("rect", { class: "bar s" + (i % 8), x: x(row.ts).toFixed(1), y: y(base + share).toFixed(1), width: width.toFixed(1), height: (y(base) - y(base + share)).toFixed(1) }));
        base += share;
      });
    }
    clear(legend);
    const totals = {};
    let all = 0;
    for (const row of rows) {
      for (const [replica, n] of Object.entries(row.replicas)) totals[replica] = (totals[replica] || 0) + n;
      all += row.requests;
    }
    replicas.forEach((replica, i) => legend.append(el("span", { class: "s" + (i % 8), "data-replica": replica, text: replica + " " + (all ? fmtPercent((totals[replica] || 0) / all) : DASH) })));
  }

  async function refreshSeries() {
    const minutes = $("plot-minutes").value;
    const series = await api("GET", "/admin/series?minutes=" + encodeURIComponent(minutes));
    const all = series.intervals || [];
    const interval = series.interval_s;
    // leading intervals without traffic (kvlb just started) are left out, down to a minute's worth
    const first = all.findIndex((r) => r.requests > 0 || r.ttft_count > 0);
    const keep = Math.max(12, Math.ceil(60 / interval));
    const rows = first < 0 ? all : all.slice(Math.max(0, Math.min(first, all.length - keep)));
    drawLines($("plot-hit"), $("legend-hit"), rows, [
      { key: "predicted_hit_rate", label: "predicted by kvlb" },
      { key: "reported_hit_rate", label: "reported by the engines" },
    ], 1, (v) => (100 * v).toFixed(0) + "%", interval);
    const ttftMax = Math.max(0.01, ...rows.map((r) => (typeof r.ttft_p90_s === "number" ? r.ttft_p90_s : 0)));
    drawLines($("plot-ttft"), $("legend-ttft"), rows, [
      { key: "ttft_p50_s", label: "p50" },
      { key: "ttft_p90_s", label: "p90" },
    ], ttftMax * 1.1, fmtSeconds, interval);
    const seen = new Set(state.replicas);
    for (const row of rows) for (const replica of Object.keys(row.replicas)) seen.add(replica);
    drawShare($("plot-share"), $("legend-share"), rows, [...seen].sort(), interval);
    const total = rows.reduce((n, r) => n + r.requests, 0);
    // kvlb serve --workers N: the series is every worker's (summed; the TTFT histograms too)
    const missing = series.workers_missing || [];
    const workers = series.workers ? " from " + series.workers.length + " workers" + (missing.length ? " (worker " + missing.join(", ") + " did not answer)" : "") : "";
    setText("plots-updated", total + " requests, " + interval + " s intervals" + workers);
  }

  // ------------------------------------------------------------------ wiring

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (event) => {
      event.preventDefault();
      $("login-error").textContent = "";
      const token = $("token").value.trim();
      if (token) login(token);
    });
    $("logout").addEventListener("click", () => logout(""));
    $("policy-name").addEventListener("change", onProposalInput);
    $("whatif-pool").addEventListener("change", onProposalInput);
    $("reason").addEventListener("input", updateApply);
    $("apply").addEventListener("click", applyProposal);
    $("reset").addEventListener("click", () => {
      if (state.policy) {
        $("policy-name").value = state.policy.name;
        buildWeights(state.policy);
      }
    });
    $("plot-minutes").addEventListener("change", () => refreshSeries().catch(() => {}));
    for (const id of ["filter-pool", "filter-replica", "filter-tenant"]) {
      $(id).addEventListener("change", () => refreshDecisions().catch(() => {}));
    }
    let tenantTimer = null;
    $("filter-tenant").addEventListener("input", () => {
      clearTimeout(tenantTimer);
      tenantTimer = setTimeout(() => refreshDecisions().catch(() => {}), WHATIF_DEBOUNCE_MS);
    });
    $("actor").value = sessionStorage.getItem(ACTOR_KEY) || "";
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) login(saved);
  });
})();
