// Runs inside an HTML output's sandboxed frame (app.js adds it to the frame's document): tells
// the page how tall the content is, so the frame fits its table instead of a fixed height.
// It says nothing else, and the page only sizes the frame the message came from.
(() => {
  const report = () => {
    const body = document.body;
    if (!body) return;
    const margin = parseFloat(getComputedStyle(body).marginBottom) || 0;
    const height = Math.ceil(body.getBoundingClientRect().bottom + window.scrollY + margin);
    parent.postMessage({ cellgateFrameHeight: height }, "*");
  };
  addEventListener("load", report);
  if (document.body) new ResizeObserver(report).observe(document.body);
  else addEventListener("DOMContentLoaded", () => new ResizeObserver(report).observe(document.body));
})();
