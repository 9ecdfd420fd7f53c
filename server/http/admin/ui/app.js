// The playground: plain JS over the server's public API, no build step, no dependencies.
// Chat streams from /v1/chat/completions; each token is a span.tok whose data-from-draft says
// whether the draft proposed it (and the target accepted it) or the target produced it.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, runs: 0 };

// --------------------------------------------------------------------------- the API
class ServerError extends Error {}

function bearer(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// /v1 endpoints take the API key (the admin key works there too); mutations the admin key.
const apiKey = () => $("api-key").value.trim() || $("admin-key").value.trim();
const adminKey = () => $("admin-key").value.trim() || $("api-key").value.trim();

async function errorMessage(response) {
  const text = await response.text();
  let message = text;
  try {
    message = JSON.parse(text).error.message;
  } catch (_) { /* not our error shape: show the body as it came */ }
  return `${response.status} ${response.statusText}: ${message || "(no message)"}`;
}

async function api(method, path, { key = apiKey(), body, signal } = {}) {
  const headers = bearer(key);
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ServerError(`cannot reach the server: ${e.message}`);
  }
  if (!response.ok) throw new ServerError(await errorMessage(response));
  return response;
}

// The `data:` payloads of a Server-Sent Events body, JSON-decoded, up to `[DONE]`.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// Streams one chat completion into `view`; resolves to the final `stats`.
async function streamChat(body, view, signal) {
  const started = performance.now();
  const response = await api("POST", "/v1/chat/completions",
    { body: { ...body, stream: true }, signal });
  let stats = null, first = null, count = 0, drafted = 0;
  for await (const chunk of sseEvents(response)) {
    if (chunk.error) throw new ServerError(`error during generation: ${chunk.error.message}`);
    if (chunk.stats) stats = chunk.stats;
    const choice = (chunk.choices || [])[0];
    if (!choice || typeof choice.from_draft !== "boolean") continue;  // the closing chunks
    first = first ?? performance.now();
    count += 1;
    drafted += choice.from_draft ? 1 : 0;
    const delta = choice.delta || {};
    if (delta.reasoning) view.token(delta.reasoning, choice.from_draft, true);
    view.token(delta.content || "", choice.from_draft);
    const seconds = (performance.now() - first) / 1000;
    view.progress({
      count, drafted, ttft: (first - started) / 1000,
      tps: count > 1 && seconds > 0 ? (count - 1) / seconds : null,
    });
  }
  if (stats === null) throw new ServerError("the stream ended without its final stats chunk");
  return stats;
}

// --------------------------------------------------------------------------- settings
function numberSetting(id) {
  const input = $(id);
  if (input.value.trim() === "") {
    if (input.validity.badInput) throw new ServerError(`${input.id}: not a number`);
    return null;
  }
  return Number(input.value);
}

function jsonSchema() {
  const text = $("json-schema").value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new ServerError(`JSON schema: not valid JSON (${e.message})`);
  }
}

// The request body: the settings as OpenAI fields plus our extensions (draft, use_draft, ...).
function requestBody(messages, { speculate = true } = {}) {
  const body = { messages };
  if (!$("target-choice").hidden) body.model = $("target").value;
  const temperature = numberSetting("temperature");
  const maxTokens = numberSetting("max-tokens");
  if (temperature !== null) body.temperature = temperature;
  if (maxTokens !== null) body.max_tokens = maxTokens;
  const drafter = $("drafter").value;
  if (!speculate || drafter === "off") {
    body.use_draft = false;
  } else {
    // "": the server's default drafter, which never fails whatever is loaded.
    if (drafter) Object.assign(body, { draft: drafter, use_draft: true });
    const k = numberSetting("num-draft-tokens");
    if (k !== null) body.num_draft_tokens = k;
    const guess = $("prediction").value;
    if (guess.trim()) body.prediction = { type: "content", content: guess };
  }
  const schema = jsonSchema();
  if (schema !== null) {
    body.response_format = {
      type: "json_schema", json_schema: { name: "playground", schema, strict: true },
    };
  }
  return body;
}

// --------------------------------------------------------------------------- rendering
// A thinking model's reasoning shows in italics (`data-reasoning`); it is not sent back.
function tokenSpan(text, fromDraft, reasoning = false) {
  const span = document.createElement("span");
  span.className = "tok";
  span.dataset.fromDraft = String(fromDraft);
  if (reasoning) span.dataset.reasoning = "true";
  span.title = (fromDraft ? "draft token, accepted by the target" : "target token") +
    (reasoning ? " (reasoning)" : "");
  span.textContent = text;
  return span;
}

// Where a stream's tokens go: an element, and optionally the live stat boxes.
function outputView(element, { live = false } = {}) {
  return {
    text: "",
    token(text, fromDraft, reasoning = false) {
      if (!reasoning) this.text += text;
      if (text) element.append(tokenSpan(text, fromDraft, reasoning));
      if (live) element.scrollIntoView({ block: "end" });
    },
    progress({ count, drafted, ttft, tps }) {
      if (!live) return;
      $("ttft").textContent = `${(ttft * 1000).toFixed(0)} ms`;
      $("tps").textContent = tps === null ? "…" : tps.toFixed(1);
      $("from-draft").textContent = percent(drafted / count);
    },
  };
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  $("chat").append(div);
  return div;
}

const percent = (x) => `${(100 * x).toFixed(1)}%`;

function showStats(stats) {
  $("tps").textContent = stats.generation_tps.toFixed(1);
  $("ttft").textContent = `${(stats.ttft_s * 1000).toFixed(0)} ms`;
  $("acceptance").textContent = stats.acceptance_rate === null
    ? "– (no draft)" : percent(stats.acceptance_rate);
  $("from-draft").textContent = percent(stats.from_draft_fraction);
  $("cached").textContent = `${stats.cached_tokens} / ${stats.prompt_tokens}`;
  $("drafter-used").textContent = stats.draft_model === null
    ? "none" : `${stats.draft_model} (num_draft_tokens ${stats.num_draft_tokens})`;
  showHistogram(stats.k_histogram || {});
}

function showHistogram(histogram) {
  const box = $("k-histogram");
  box.replaceChildren();
  const entries = Object.entries(histogram);
  if (entries.length === 0) {
    box.textContent = "no speculative rounds";
    return;
  }
  const most = Math.max(...entries.map(([, n]) => n));
  for (const [k, n] of entries) {
    const row = document.createElement("div");
    row.className = "bar-row";
    const label = document.createElement("span");
    label.textContent = `k=${k}`;
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${(100 * n) / most}%`;
    const count = document.createElement("span");
    count.textContent = String(n);
    row.append(label, bar, count);
    box.append(row);
  }
}

function resetStats() {
  for (const id of ["tps", "ttft", "acceptance", "from-draft", "cached", "drafter-used"]) {
    $(id).textContent = "–";
  }
  $("k-histogram").replaceChildren();
}

function showError(error) {
  const box = $("error");
  box.textContent = error.message;
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// --------------------------------------------------------------------------- actions
// Runs one generation at a time: the buttons lock, Stop aborts, errors land in #error.
// body[data-runs] counts the finished runs (what tests and the screenshot script wait for).
async function exclusive(action) {
  if (state.controller) return;
  clearError();
  state.controller = new AbortController();
  setBusy(true);
  try {
    await action(state.controller.signal);
  } catch (e) {
    if (e.name !== "AbortError") showError(e);
  } finally {
    if (!$("target-choice").hidden) {  // the run may have switched the target
      await showHealth();
      await refreshModels({ candidates: false }).catch(() => {});
    }
    state.controller = null;
    state.runs += 1;
    document.body.dataset.runs = String(state.runs);
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("compare").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.busy = String(busy);
}

function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  return exclusive(async (signal) => {
    const messages = [...state.messages, { role: "user", content: prompt }];
    const body = requestBody(messages);
    $("prompt").value = "";
    addMessage("user", prompt);
    const bubble = addMessage("assistant", "");
    resetStats();
    const view = outputView(bubble, { live: true });
    try {
      showStats(await streamChat(body, view, signal));
    } catch (e) {
      if (e.name !== "AbortError") {
        bubble.classList.add("failed");
        if (!$("prompt").value) $("prompt").value = prompt;  // to retry
        throw e;
      }
    }
    state.messages = [...messages, { role: "assistant", content: view.text }];
  });
}

// One stream into a compare column; its stats, shown above the column.
async function compareRun(column, body, signal) {
  const output = column.querySelector(".output");
  output.replaceChildren();
  column.querySelector(".run-stats").textContent = "running…";
  const view = outputView(output);
  const stats = await streamChat(body, view, signal);
  column.querySelector(".run-stats").textContent =
    `${stats.generation_tps.toFixed(1)} tok/s, ${stats.generation_tokens} tokens`;
  return { stats, text: view.text };
}

function compare() {
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  return exclusive(async (signal) => {
    const messages = [{ role: "user", content: prompt }];
    if ($("drafter").value === "off") {
      throw new ServerError("Compare needs a drafter: pick one in Settings (not off)");
    }
    const withDraft = requestBody(messages);
    const without = requestBody(messages, { speculate: false });
    $("compare-panel").hidden = false;
    $("speedup").textContent = "";
    $("compare-note").textContent = "";
    // One after the other, so neither run shares the machine with the other.
    const plain = await compareRun($("compare-plain"), without, signal);
    const spec = await compareRun($("compare-spec"), withDraft, signal);
    const speedup = spec.stats.generation_tps / plain.stats.generation_tps;
    $("speedup").textContent = Number.isFinite(speedup)
      ? `speedup ${speedup.toFixed(2)}x` : "speedup n/a (too few tokens to time)";
    $("speedup").dataset.speedup = speedup.toFixed(3);
    $("speedup").classList.toggle("slower", speedup < 1);
    showStats(spec.stats);
    $("compare-note").textContent = compareNote(spec, plain, withDraft.temperature);
  });
}

function compareNote(spec, plain, temperature) {
  const tps = `generation tok/s: ${spec.stats.generation_tps.toFixed(1)} with ` +
    `${spec.stats.draft_model ?? "no drafter"} vs ${plain.stats.generation_tps.toFixed(1)} ` +
    "without (one run each: timings vary with the machine's load)";
  if (temperature !== 0) return `${tps}. At temperature > 0 the two texts are samples.`;
  const same = spec.text === plain.text;
  return `${tps}. Greedy: the texts are ${same ? "identical" : "DIFFERENT"}.`;
}

// --------------------------------------------------------------------------- admin
function adminStatus(message, isError = false) {
  const box = $("admin-status");
  box.textContent = message;
  box.classList.toggle("error", isError);
}

async function admin(action) {
  adminStatus("");
  try {
    await action();
  } catch (e) {
    adminStatus(e.message, true);
  }
}

// `candidates`: also list the draft candidates (an admin endpoint: not at page load, before
// a key could be typed, which would log a 401).
async function refreshModels({ candidates = true } = {}) {
  const models = (await (await api("GET", "/v1/models")).json()).data;
  const list = $("model-list");
  list.replaceChildren();
  for (const model of models) {
    const item = document.createElement("li");
    item.dataset.role = model.role;
    item.textContent = `${model.role}: ${model.id}`;
    item.title = model.path;
    list.append(item);
  }
  const draft = models.find((m) => m.role === "draft");
  const target = models.find((m) => m.role === "target");
  chooseAmong(models.filter((m) => m.role === "target" || m.role === "standby"), target);
  $("target-name").textContent = target ? target.id : "?";
  $("draft-name").textContent = draft ? draft.id : "none";
  if (draft && !$("draft-path").value) $("draft-path").value = draft.path;
  if (candidates) await listCandidates();
}

// With several targets (`models.more_targets`), the Model list picks the one a chat names;
// the choice stays as the list refreshes.
function chooseAmong(targets, serving) {
  const select = $("target");
  const chosen = select.value || (serving ? serving.id : "");
  select.replaceChildren(...targets.map((m) => new Option(m.id, m.id)));
  if (targets.some((m) => m.id === chosen)) select.value = chosen;
  $("target-choice").hidden = targets.length < 2;
}

// The local models that could draft for the target, offered in the draft path's list. An
// admin endpoint: without the key (yet) the list stays empty, and that is no error.
async function listCandidates() {
  const list = $("draft-candidates");
  try {
    const found = (await (await api("GET", "/v1/models/draft/candidates",
      { key: adminKey() })).json()).data;
    list.replaceChildren(...found.map((c) => {
      const option = document.createElement("option");
      option.value = c.path;
      option.label = `${c.size_gb} GB${c.loaded ? " (loaded)" : ""}`;
      return option;
    }));
  } catch (e) {
    list.replaceChildren();
  }
}

async function loadDraft() {
  const model = $("draft-path").value.trim();
  if (!model) throw new ServerError("type a draft model's path or id first");
  adminStatus(`loading ${model}…`);
  const card = await (await api("POST", "/v1/models/draft",
    { key: adminKey(), body: { model } })).json();
  adminStatus(`loaded ${card.id} (${card.parameters.toLocaleString()} parameters, ` +
    `k=${card.num_draft_tokens})`);
  await refreshModels();
}

async function unloadDraft() {
  const result = await (await api("DELETE", "/v1/models/draft", { key: adminKey() })).json();
  adminStatus(`unloaded ${result.id}`);
  await refreshModels();
}

// --------------------------------------------------------------------------- server-wide
// The Server panel: every request's figures, from /metrics (Prometheus text, no key needed),
// refreshed every few seconds while the page is in view.
const SERVER_REFRESH_MS = 2000;

// Each metric's value, its labelled series summed ("name{labels} value" lines); and under
// "name{labels}", each series' own.
function metricSums(text) {
  const sums = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const cut = line.lastIndexOf(" ");
    const series = line.slice(0, cut);
    const name = series.replace(/\{.*\}$/, "");
    const value = Number(line.slice(cut + 1));
    sums[name] = (sums[name] ?? 0) + value;
    if (series !== name) sums[series] = value;
  }
  return sums;
}

// "model 45.8% · prompt_lookup 80.0%": each drafter's acceptance.
function drafterAcceptance(m) {
  const proposed = /^mlx_spec_drafter_draft_tokens_total\{drafter="(.*)"\}$/;
  const parts = [];
  for (const [series, count] of Object.entries(m)) {
    const found = series.match(proposed);
    if (!found || count <= 0) continue;
    const accepted = m[`mlx_spec_drafter_accepted_tokens_total{drafter="${found[1]}"}`] ?? 0;
    parts.push(`${found[1]} ${share(accepted, count)}`);
  }
  return parts.length ? parts.sort().join(" \u00b7 ") : "\u2013";
}

const share = (part, whole) => (whole > 0 ? percent(part / whole) : "\u2013");

async function showServerStats() {
  if (document.visibilityState === "hidden") return;
  const m = metricSums(await (await api("GET", "/metrics")).text());
  const generated = m.mlx_spec_generated_tokens_total ?? 0;
  const accepted = m.mlx_spec_spec_decode_num_accepted_tokens_total ?? 0;
  $("srv-requests").textContent = String(m.mlx_spec_completions_total ?? 0);
  $("srv-tokens").textContent = String(generated);
  $("srv-from-draft").textContent = share(accepted, generated);
  $("srv-acceptance").textContent = share(accepted,
    m.mlx_spec_spec_decode_num_draft_tokens_total ?? 0);
  $("srv-drafters").textContent = drafterAcceptance(m);
  $("srv-load").textContent =
    `${m.mlx_spec_running_requests ?? 0} / ${m.mlx_spec_queue_depth ?? 0}`;
  $("srv-cached").textContent = share(m.mlx_spec_prefix_cache_hits_total ?? 0,
    m.mlx_spec_prefix_cache_queries_total ?? 0);
}

function watchServer() {
  const refresh = () => showServerStats().catch(() => {});  // a missed refresh is no error
  refresh();
  setInterval(refresh, SERVER_REFRESH_MS);
}

// The header names the models even before a key is typed: /health needs none.
async function showHealth() {
  try {
    const health = await (await api("GET", "/health")).json();
    $("target-name").textContent = health.target;
    $("draft-name").textContent = health.draft ?? "none";
  } catch (e) {
    showError(e);
  }
}

// --------------------------------------------------------------------------- wiring
function onPromptKey(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
}

function newChat() {
  state.messages = [];
  $("chat").replaceChildren();
  clearError();
  resetStats();
}

document.addEventListener("DOMContentLoaded", () => {
  $("prompt").addEventListener("keydown", onPromptKey);
  $("send").addEventListener("click", send);
  $("compare").addEventListener("click", compare);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("refresh-models").addEventListener("click", () => admin(refreshModels));
  $("load-draft").addEventListener("click", () => admin(loadDraft));
  $("unload-draft").addEventListener("click", () => admin(unloadDraft));
  document.body.dataset.runs = "0";
  setBusy(false);
  showHealth();
  watchServer();
  admin(() => refreshModels({ candidates: false }));
});
