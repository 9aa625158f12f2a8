// A small Markdown subset as DOM nodes: paragraphs, fenced code blocks, headings, lists,
// inline code, bold and italic. Text only ever enters the DOM as text nodes (append of a
// string, textContent), never as HTML, so `<script>` or `<img onerror=...>` in model
// output shows as the characters it is made of.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d{1,9}[.)]\s+(.*)$/;
// `code` | **bold** | __bold__ | *italic* | _italic_ (an underscore inside a word is text)
const INLINE = new RegExp([
  /`([^`\n]+)`/.source,
  /\*\*(?=\S)(.+?)(?<=\S)\*\*/.source,
  /(?<![\w])__(?=\S)(.+?)(?<=\S)__(?![\w])/.source,
  /\*(?=[^\s*])(.+?)(?<=[^\s*])\*/.source,
  /(?<![\w])_(?=[^\s_])(.+?)(?<=[^\s_])_(?![\w])/.source,
].join("|"), "gs");

/** The nodes of `text` rendered as Markdown, in a DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let paragraph = [];
  let list = null;

  const flushParagraph = () => {
    if (paragraph.length) {
      fragment.append(inline("p", paragraph.join("\n")));
    }
    paragraph = [];
  };
  const endBlock = () => {
    flushParagraph();
    list = null;
  };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    let m;
    if (fence) {
      endBlock();
      // an unclosed fence (mid-stream) runs to the end of the text
      let end = i + 1;
      while (end < lines.length && !lines[end].trim().startsWith(fence[1])) end++;
      fragment.append(codeBlock(lines.slice(i + 1, end).join("\n"), fence[2]));
      i = end;
    } else if (!line.trim()) {
      endBlock();
    } else if ((m = line.match(HEADING))) {
      endBlock();
      // "#" is an h2: the page's own title is its h1
      fragment.append(inline(`h${Math.min(m[1].length + 1, 6)}`, m[2]));
    } else if ((m = line.match(BULLET) || line.match(NUMBERED))) {
      flushParagraph();
      const tag = line.match(BULLET) ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = document.createElement(tag);
        fragment.append(list);
      }
      list.append(inline("li", m[1]));
    } else {
      list = null;
      paragraph.push(line);
    }
  }
  flushParagraph();
  return fragment;
}

function codeBlock(code, language) {
  const pre = document.createElement("pre");
  if (language) {
    const label = document.createElement("span");
    label.className = "code-language";
    label.textContent = language;
    pre.append(label);
  }
  const element = document.createElement("code");
  element.textContent = code;
  pre.append(element);
  return pre;
}

/** A `tag` element holding `text` with its inline marks (code, bold, italic). */
function inline(tag, text) {
  const element = document.createElement(tag);
  appendInline(element, text);
  return element;
}

function appendInline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    parent.append(text.slice(last, m.index));
    if (m[1] !== undefined) {
      const code = document.createElement("code");
      code.textContent = m[1];
      parent.append(code);
    } else {
      const bold = m[2] ?? m[3];
      parent.append(inline(bold !== undefined ? "strong" : "em", bold ?? m[4] ?? m[5]));
    }
    last = m.index + m[0].length;
  }
  parent.append(text.slice(last));
}
