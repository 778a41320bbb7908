// A small syntax highlighter for the code shown in the conversation: comments, strings,
// keywords, numbers (and bash's variables) of Python, TypeScript/JavaScript, R and bash.
// No dependency, no HTML parsing: the code is cut into text nodes and <span class="tok-…">
// elements whose textContent is the code itself, so nothing in it can become markup.
// A language it does not know is shown plain.

const NUMBER = String.raw`\b(?:0[xX][0-9a-fA-F_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?)\b`;
// A string closed on its line, or running to the line's end while it is being typed.
const quoted = (q) => `${q}(?:\\\\.|[^${q}\\\\\\n])*${q}?`;

const words = (list) => String.raw`\b(?:${list.split(/\s+/).filter(Boolean).join("|")})\b`;

// Per language, [class, pattern] in order of precedence (the first that matches at a
// position wins, so a `#` inside a string stays in the string).
const RULES = {
  python: [
    ["comment", String.raw`#[^\n]*`],
    ["string", String.raw`[rRbBfFuU]{0,2}(?:"""[\s\S]*?(?:"""|$(?![\s\S]))|'''[\s\S]*?(?:'''|$(?![\s\S])))`],
    ["string", String.raw`[rRbBfFuU]{0,2}(?:${quoted('"')}|${quoted("'")})`],
    ["keyword", words(`False None True and as assert async await break class continue def del
      elif else except finally for from global if import in is lambda nonlocal not or pass
      raise return try while with yield match case`)],
    ["number", NUMBER],
  ],
  typescript: [
    ["comment", String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$(?![\s\S]))`],
    ["string", String.raw`${quoted('"')}|${quoted("'")}|\x60(?:\\[\s\S]|[^\\\x60])*\x60?`],
    ["keyword", words(`abstract any as async await boolean break case catch class const
      continue debugger declare default delete do else enum export extends false finally for
      from function get if implements import in instanceof interface keyof let namespace never
      new null number of private protected public readonly return set static string super
      switch this throw true try type typeof undefined unknown var void while with yield`)],
    ["number", NUMBER],
  ],
  r: [
    ["comment", String.raw`#[^\n]*`],
    ["string", `${quoted('"')}|${quoted("'")}`],
    ["keyword", words(`if else repeat while function for in next break return TRUE FALSE
      NULL Inf NaN NA NA_integer_ NA_real_ NA_character_ library require`)],
    ["number", String.raw`\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?L?\b`],
  ],
  bash: [
    // `#` starts a comment only as a word's first character (`$#`, `a#b` are not).
    ["comment", String.raw`(?<![^\s;|&(])#[^\n]*`],
    ["string", String.raw`${quoted('"')}|'[^']*'?`],
    ["variable", String.raw`\$(?:\{[^}\n]*\}?|[A-Za-z_]\w*|[@#?$!*\d-])`],
    ["keyword", words(`if then else elif fi case esac for select while until do done in
      function time return local export declare readonly unset break continue exit`)],
    ["number", String.raw`\b\d+\b`],
  ],
};
const ALIASES = { javascript: "typescript", js: "typescript", ts: "typescript", sh: "bash", shell: "bash", python3: "python" };

const compiled = new Map();

// One regular expression per language: a named group per rule, tried left to right.
function grammar(language) {
  const key = String(language ?? "").toLowerCase();
  const name = ALIASES[key] ?? key;
  if (!RULES[name]) return null;
  if (!compiled.has(name)) {
    const rules = RULES[name];
    const source = rules.map(([, pattern], i) => `(?<t${i}>${pattern})`).join("|");
    compiled.set(name, { rules, pattern: new RegExp(source, "gm") });
  }
  return compiled.get(name);
}

/** Whether `language` is one this highlighter knows. */
export function knows(language) {
  return grammar(language) !== null;
}

/** `code` as nodes to append to a <pre>: text, and spans `tok-comment`, `tok-string`,
 * `tok-keyword`, `tok-number`, `tok-variable`. */
export function highlight(code, language) {
  const text = String(code ?? "");
  const found = grammar(language);
  if (!found) return [document.createTextNode(text)];
  const { rules, pattern } = found;
  const nodes = [];
  let at = 0;
  pattern.lastIndex = 0;
  for (let match; (match = pattern.exec(text)); ) {
    if (match[0] === "") {
      // An empty match (a string pattern at the very end) would loop forever.
      pattern.lastIndex += 1;
      continue;
    }
    if (match.index > at) nodes.push(document.createTextNode(text.slice(at, match.index)));
    const rule = rules.findIndex((_, i) => match.groups[`t${i}`] !== undefined);
    const span = document.createElement("span");
    span.className = `tok-${rules[rule][0]}`;
    span.textContent = match[0];
    nodes.push(span);
    at = match.index + match[0].length;
  }
  if (at < text.length) nodes.push(document.createTextNode(text.slice(at)));
  return nodes;
}
