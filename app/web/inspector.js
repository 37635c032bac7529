// The token inspector: for a token of an answer, the table the sampler worked from ("inspect" on the API): the
// best candidates, their probability after each stage, which one was drawn, and which stage cut which.

export const $ = (id) => document.getElementById(id);
let pinned = null;  // a clicked token keeps its table on screen while the mouse moves on

export function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

export function clearInspector() {
  pinned = null;
  $("inspector-body").replaceChildren();
  $("inspector-hint").hidden = false;
}

export function tokenSpan(text, inspections, answer) {
  return makeInspectable(element("span", "", text), inspections, answer);
}

export function makeInspectable(span, inspections, answer) {
  span.classList.add("tok");
  span.tabIndex = 0;
  span.inspections = inspections;
  span.answer = answer;
  span.addEventListener("mouseenter", () => { if (!pinned) showInspection(span); });
  span.addEventListener("focus", () => { if (!pinned) showInspection(span); });
  span.addEventListener("click", () => pin(span));
  return span;
}

function pin(span) {
  if (pinned) pinned.classList.remove("pinned");
  pinned = pinned === span ? null : span;
  if (pinned) span.classList.add("pinned");
  showInspection(span);
}

// How a token looks in the table: quoted, with spaces and line breaks made visible.
function visible(text) {
  return text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function stageLabel(stage, p) {
  if (!p) return stage;
  switch (stage) {
    case "raw": return "model";
    case "penalties": return p.repetition_penalty !== 1 ? `penalties (×${p.repetition_penalty})` : "penalties";
    case "temperature": return `temperature ${p.temperature}`;
    case "top_k": return p.top_k > 0 ? `top-k ${p.top_k}` : "top-k (off)";
    case "top_p": return p.top_p < 1 ? `top-p ${p.top_p}` : "top-p (off)";
    case "min_p": return p.min_p > 0 ? `min-p ${p.min_p}` : "min-p (off)";
    default: return stage;
  }
}

function formatProb(p) {
  if (p === 0) return "cut";
  return p < 0.0005 ? "<0.001" : p.toFixed(3);
}

function showInspection(span) {
  for (const el of document.querySelectorAll(".tok.shown")) el.classList.remove("shown");
  span.classList.add("shown");
  $("inspector-hint").hidden = true;
  const body = $("inspector-body");
  body.replaceChildren();
  for (const inspection of span.inspections) body.append(inspectionTable(inspection, span.answer.params));
}

function inspectionTable(inspection, params) {
  const box = element("div", "inspection");
  const title = element("p", "drawn-token");
  title.append("drawn: ", element("code", "", `'${visible(inspection.token.text)}'`), ` (id ${inspection.token.id})`);
  box.append(title);
  const table = element("table", "stages");
  const head = element("tr");
  head.append(element("th", "", "candidate"));
  for (const stage of inspection.stages) {
    const th = element("th", "", stageLabel(stage, params));
    th.dataset.stage = stage;
    head.append(th);
  }
  table.append(element("thead"));
  table.tHead.append(head);
  const rows = element("tbody");
  for (const candidate of inspection.candidates) {
    const drawn = candidate.id === inspection.token.id;
    const row = element("tr", drawn ? "drawn" : "");
    row.dataset.tokenId = candidate.id;
    row.append(element("td", "token", `${drawn ? "\u2605 " : ""}'${visible(candidate.text)}'`));
    for (const p of candidate.probs) {
      const cell = element("td", p === 0 ? "prob cut" : "prob", formatProb(p));
      cell.style.setProperty("--p", p);
      row.append(cell);
    }
    rows.append(row);
  }
  table.append(rows);
  box.append(table);
  box.append(element("p", "muted legend", "\u2605 drawn · cut: that stage removed the token · candidates: the "
    + "best after the penalties, the order every later stage keeps"));
  return box;
}
