// Loads each URL of IMG_URLS (a JSON array) in an <img> of a page with no origin of the
// gateway's (about:blank) and no credential, in Debian's headless Chromium; prints one JSON
// line: the naturalWidth of each (0: the image did not load). Run by
// tests/it/artifact_links.rs: a signed artifact link must load, the plain URL must not.

import { chromium } from "playwright-core";

const urls = JSON.parse(process.env.IMG_URLS ?? "[]");
const executablePath = process.env.CHROMIUM ?? "/usr/bin/chromium";
const browser = await chromium.launch({
  executablePath,
  headless: true,
  // Root in a container: Chromium's own sandbox needs user namespaces it may not get.
  args: ["--no-sandbox", "--disable-dev-shm-usage"],
});
try {
  const page = await (await browser.newContext()).newPage();
  const widths = await page.evaluate(async (urls) => {
    const load = (url) =>
      new Promise((resolve) => {
        const img = new Image();
        img.onload = () => resolve(img.naturalWidth);
        img.onerror = () => resolve(0);
        img.src = url;
        document.body.append(img);
      });
    return Promise.all(urls.map(load));
  }, urls);
  console.log(JSON.stringify({ origin: page.url(), widths }));
} finally {
  await browser.close();
}
