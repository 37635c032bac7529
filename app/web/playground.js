// The playground: a chat that streams from /v1/chat/completions, and the token inspector.
//
// No build step and no library: the page asks the server for the model and its sampling defaults (GET /v1/models),
// sends the conversation with the controls' values and "inspect": {"top": N}, reads the SSE stream itself (fetch,
// since EventSource cannot POST), and keeps, for each token of an answer, the table the sampler worked from
// (inspector.js draws it). A model that takes images gets an image attachment on each message (attach.js).
import {clearAttachment, enableAttachments, pendingImage, setupAttachments, thumbnail} from "./attach.js";
import {$, clearInspector, element, makeInspectable, tokenSpan} from "./inspector.js";

const CONTROLS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty"];
const state = {model: null, defaults: null, history: [], controller: null};

function requestHeaders() {
  const headers = {"Content-Type": "application/json"};
  const key = $("api_key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

// ---- the model and its defaults ----

async function loadModel() {
  let response;
  try {
    response = await fetch("/v1/models", {headers: requestHeaders()});
  } catch (err) {
    $("model").textContent = `server unreachable: ${err}`;
    return;
  }
  if (!response.ok) {
    $("model").textContent = `could not list the model: ${await errorMessage(response)}`;
    return;
  }
  const model = (await response.json()).data[0];
  if (!model.sampling_defaults) {  // still loading: the defaults come with the model
    $("model").textContent = `${model.id}: loading…`;
    setTimeout(loadModel, 1000);
    return;
  }
  state.model = model.id;
  state.defaults = model.sampling_defaults;
  $("model").textContent = `${model.id} · context ${model.max_model_len} tokens`;
  $("max_tokens").max = model.max_model_len;
  enableAttachments(Boolean(model.capabilities && model.capabilities.vision));
  applyDefaults();
}

function applyDefaults() {
  const d = state.defaults;
  for (const name of CONTROLS) $(name).value = d[name];
  if (!d.do_sample) $("temperature").value = 0;  // a greedy model: temperature 0 says so to the server
}

function numberOrNull(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  const body = {model: state.model, messages: messages.concat(state.history), stream: true};
  for (const name of [...CONTROLS, "seed", "max_tokens"]) {
    const value = numberOrNull(name);
    if (value !== null) body[name] = value;
  }
  if ($("inspect").checked) body.inspect = {top: numberOrNull("inspect_top") ?? 10};
  return body;
}

// ---- streaming ----

// Yields each SSE event's JSON until `data: [DONE]`; ping comments and blank events are skipped.
async function* sseEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// What a user message sends: its text as a plain string, as before images; with an image, OpenAI's content parts
// (the text, then the image), which the history keeps, so that later turns still show the model the image.
function userContent(text, image) {
  if (!image) return text;
  const parts = text ? [{type: "text", text}] : [];
  return parts.concat({type: "image_url", image_url: {url: image.url}});
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  const image = pendingImage();
  if ((!text && !image) || state.controller || !state.model) return;
  $("prompt").value = "";
  clearAttachment();
  addMessage("user", text, image);
  state.history.push({role: "user", content: userContent(text, image)});
  const answer = addAnswer();
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: requestHeaders(),
      body: JSON.stringify(requestBody()), signal: state.controller.signal});
    if (!response.ok) {
      answer.fail(await errorMessage(response));
      state.history.pop();
      return;
    }
    answer.setParams(JSON.parse(response.headers.get("x-sampling-params") || "null"));
    for await (const data of sseEvents(response.body)) {
      if (data.error) {
        answer.fail(data.error.message);
        break;
      }
      const choice = data.choices && data.choices[0];
      if (!choice) continue;
      answer.add(choice.delta || {}, choice.inspect);
      if (choice.finish_reason) answer.finish(choice.finish_reason);
    }
  } catch (err) {
    if (err.name === "AbortError") answer.finish("stopped");
    else answer.fail(String(err));
  } finally {
    if (answer.text) state.history.push({role: "assistant", content: answer.text});
    state.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- the conversation ----

function addMessage(role, text, image) {
  const el = element("div", `message ${role}`);
  if (image) el.append(thumbnail(image));
  el.append(element("div", "content", text));
  $("messages").append(el);
  el.scrollIntoView({block: "end"});
  return el;
}

// An answer being streamed. Tokens that show no text yet (half a character, a possible stop string) keep their
// inspection until a token brings text: that span then holds all of them. What is left at the end (EOS, a stop
// string) becomes a dimmed span, so every generated token can be inspected.
// A reasoning model's thinking (delta.reasoning_content) goes to a block of its own. The server sends a thinking
// token's text in one chunk and its inspection in the next one, which then has no text of its own.
function addAnswer() {
  const el = addMessage("assistant", "");
  el.classList.add("streaming");
  const content = el.querySelector(".content");
  const meta = element("div", "meta");
  el.append(meta);
  let pending = [], thinking = null, lastThought = null;
  const answer = {
    text: "",
    params: null,
    add(delta, inspection) {
      if (delta.reasoning_content) {
        if (!thinking) {
          thinking = element("details", "thinking");
          thinking.open = true;
          thinking.append(element("summary", "", "thinking"), element("div", "thought"));
          el.insertBefore(thinking, content);
        }
        lastThought = element("span", "", delta.reasoning_content);
        thinking.lastChild.append(lastThought);
        return;
      }
      if (inspection) pending.push(inspection);
      const text = delta.content || "";
      if (lastThought && !text && pending.length) {  // the inspection of the thinking just shown
        makeInspectable(lastThought, pending, answer);
        pending = [];
      }
      lastThought = null;
      if (!text) return;
      answer.text += text;
      content.append(pending.length ? tokenSpan(text, pending, answer) : document.createTextNode(text));
      pending = [];
      el.scrollIntoView({block: "end"});
    },
    finish(reason) {
      if (pending.length) {
        const span = tokenSpan(pending.map((p) => p.token.text).join(""), pending, answer);
        span.classList.add("unshown");
        span.title = "generated but not part of the answer (end of text or a stop string)";
        content.append(span);
        pending = [];
      }
      el.classList.remove("streaming");
      meta.append(element("span", "finish", `finish: ${reason}`));
    },
    fail(message) {
      el.classList.remove("streaming");
      el.classList.add("failed");
      el.append(element("div", "error", message));
    },
    setParams(params) {
      answer.params = params;
      if (params) meta.append(describeParams(params));
    },
  };
  return answer;
}

// The effective parameters of one answer, from its x-sampling-params header.
function describeParams(p) {
  const box = element("span", "params");
  const parts = p.do_sample ? [["temperature", "temperature"], ["top_k", "top-k"], ["top_p", "top-p"],
    ["min_p", "min-p"], ["repetition_penalty", "repetition penalty"]] : [["repetition_penalty", "repetition penalty"]];
  if (!p.do_sample) box.append(element("span", "param", "greedy"));
  for (const [key, label] of [...parts, ["seed", "seed"], ["max_tokens", "max tokens"]]) {
    if (p[key] === null || p[key] === undefined) continue;
    const item = element("span", "param", `${label} ${p[key]}`);
    item.dataset.param = key;
    item.dataset.value = p[key];
    box.append(item);
  }
  return box;
}

// ---- wiring ----

function newChat() {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("messages").replaceChildren();
  clearInspector();
}

$("composer").addEventListener("submit", send);
setupAttachments();
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {  // Enter sends, Shift+Enter is a new line
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", newChat);
$("defaults").addEventListener("click", () => state.defaults && applyDefaults());
$("api_key").addEventListener("change", loadModel);
loadModel();
