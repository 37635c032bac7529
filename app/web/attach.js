// Image attachments, for a model that takes images (GET /v1/models: "capabilities": {"vision": true}).
//
// The user picks an image (the "Image…" button), drops it on the message box or pastes it. It is read here, in the
// browser, as a data URL (FileReader): the server reads data URLs itself, and needs no host of ours to fetch from.
// One image waits at a time, shown as a thumbnail with a button to remove it; the next message sends it as an
// OpenAI `image_url` content part (playground.js builds the parts).
import {$, element} from "./inspector.js";

// What the model's processor opens (the server decodes with Pillow, app/images.py); the browser names them so.
const TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
// Refused here rather than sent: base64 makes a data URL a third larger than the file, and the whole conversation
// (every earlier image too) goes with each request, which the server bounds (MAX_REQUEST_BYTES, 413 past it).
export const MAX_IMAGE_BYTES = 4 * 2 ** 20;

let enabled = false;
let pending = null;  // {url, name}: the image the next message sends
let reading = 0;  // which read is the latest: a slow read of an earlier file must not replace a later one

// Shown only for a model that takes images; otherwise the attachment (if any) goes, so nothing sends one.
export function enableAttachments(on) {
  enabled = on;
  $("attach").hidden = !on;
  if (!on) clearAttachment();
}

export function pendingImage() {
  return pending;
}

export function clearAttachment() {
  pending = null;
  reading += 1;
  $("attach-file").value = "";  // so that picking the same file again fires "change"
  $("attachment").replaceChildren();
  $("attachment").hidden = true;
  showProblem("");
}

function showProblem(message) {
  $("attach-error").textContent = message;
  $("attach-error").hidden = !message;
}

function megabytes(bytes) {
  return `${(bytes / 2 ** 20).toFixed(1)} MB`;
}

async function attach(file) {
  if (!enabled) return;
  clearAttachment();
  if (!TYPES.includes(file.type)) {
    showProblem(`${file.name}: not an image this page sends (PNG, JPEG, WebP or GIF)`);
    return;
  }
  if (file.size > MAX_IMAGE_BYTES) {
    showProblem(`${file.name} is ${megabytes(file.size)}; images of at most ${megabytes(MAX_IMAGE_BYTES)} are sent`);
    return;
  }
  const mine = reading;
  let url;
  try {
    url = await readAsDataUrl(file);
  } catch (err) {
    showProblem(`${file.name}: could not be read (${err})`);
    return;
  }
  if (mine !== reading) return;  // removed, or replaced by another file, while it was being read
  pending = {url, name: file.name};
  const remove = element("button", "remove", "\u00d7");
  remove.type = "button";
  remove.setAttribute("aria-label", `Remove ${file.name}`);
  remove.addEventListener("click", () => { clearAttachment(); $("prompt").focus(); });
  $("attachment").replaceChildren(thumbnail(pending), remove);
  $("attachment").hidden = false;
}

// A small picture of an image ({url, name}): the pending one here, and the one in a user's turn (playground.js).
export function thumbnail(image) {
  const img = element("img", "thumb");
  img.src = image.url;
  img.alt = image.name;
  img.title = image.name;
  return img;
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// The first file of a drop or a paste, or null (text being dropped or pasted is left to the textarea).
function firstFile(transfer) {
  return transfer && transfer.files && transfer.files.length ? transfer.files[0] : null;
}

export function setupAttachments() {
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", () => {
    const file = $("attach-file").files[0];
    if (file) attach(file);
  });
  const box = $("prompt");
  box.addEventListener("dragover", (event) => {
    if (!enabled || !event.dataTransfer.types.includes("Files")) return;
    event.preventDefault();  // without it, the browser would open the dropped file in place of the page
    event.dataTransfer.dropEffect = "copy";
    box.classList.add("dropping");
  });
  box.addEventListener("dragleave", () => box.classList.remove("dropping"));
  box.addEventListener("drop", (event) => {
    box.classList.remove("dropping");
    const file = enabled && firstFile(event.dataTransfer);
    if (!file) return;
    event.preventDefault();
    attach(file);
  });
  box.addEventListener("paste", (event) => {
    const file = enabled && firstFile(event.clipboardData);
    if (!file) return;  // plain text pastes as usual
    event.preventDefault();
    attach(file);
  });
}
