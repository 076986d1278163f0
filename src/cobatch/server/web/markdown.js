// A small Markdown renderer for model replies: fenced code blocks, headings, lists, block quotes, paragraphs, and
// inline code, bold, italic and http(s) links. Every piece of text is HTML-escaped before any tag is added, so
// a reply can never inject markup; an unclosed fence (a reply still streaming) runs to the end as code.
"use strict";

const markdown = (() => {
  function escape(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
               .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  function inline(text) {
    const codes = [];
    let out = text.replace(/`([^`\n]+)`/g, (_, code) => "\u0000" + (codes.push(code) - 1) + "\u0000");
    out = escape(out);
    out = out.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
                      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    out = out.replace(/\*\*([^*\n]+?)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+?)__/g, "<strong>$1</strong>");
    out = out.replace(/(^|[^\w*])\*([^*\s][^*\n]*?)\*(?!\w)/g, "$1<em>$2</em>")
             .replace(/(^|[^\w])_([^_\s][^_\n]*?)_(?!\w)/g, "$1<em>$2</em>");
    return out.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + escape(codes[Number(i)]) + "</code>");
  }

  const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

  // Block structure of a stretch of text with no code fences in it.
  function blocks(text) {
    const html = [];
    const lines = text.split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) { i++; continue; }
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (heading) {
        const level = heading[1].length;
        html.push(`<h${level}>${inline(heading[2])}</h${level}>`);
        i++;
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { html.push("<hr>"); i++; continue; }
      if (/^\s*>/.test(line)) {
        const quoted = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
        html.push("<blockquote>" + blocks(quoted.join("\n")) + "</blockquote>");
        continue;
      }
      const item = LIST_ITEM.exec(line);
      if (item) {
        const ordered = /\d/.test(item[2]);
        const entries = [];
        while (i < lines.length) {
          const m = LIST_ITEM.exec(lines[i]);
          if (m && /\d/.test(m[2]) === ordered) entries.push(m[3]);
          else if (lines[i].trim() && entries.length && /^\s+/.test(lines[i])) entries[entries.length - 1] += " " + lines[i].trim();
          else break;
          i++;
        }
        const tag = ordered ? "ol" : "ul";
        html.push(`<${tag}>` + entries.map((e) => "<li>" + inline(e) + "</li>").join("") + `</${tag}>`);
        continue;
      }
      const paragraph = [];
      while (i < lines.length && lines[i].trim() && !LIST_ITEM.test(lines[i]) && !/^(#{1,6})\s/.test(lines[i])
             && !/^\s*>/.test(lines[i])) {
        paragraph.push(lines[i++]);
      }
      html.push("<p>" + paragraph.map(inline).join("<br>") + "</p>");
    }
    return html.join("");
  }

  function render(text) {
    const out = [];
    const fence = /^ {0,3}(```|~~~)\s*([\w+#.-]*)[^\n]*$/gm;
    let at = 0;
    let open;
    text = text.replace(/\u0000/g, "");
    while ((open = fence.exec(text)) !== null) {
      out.push(blocks(text.slice(at, open.index)));
      const start = open.index + open[0].length + 1;
      const close = new RegExp("^ {0,3}" + open[1] + "\\s*$", "gm");
      close.lastIndex = start;
      const end = close.exec(text);
      const code = text.slice(start, end ? end.index : text.length).replace(/\n$/, "");
      const language = open[2] ? ` class="language-${escape(open[2])}"` : "";
      out.push(`<pre><code${language}>${escape(code)}</code></pre>`);
      if (!end) return out.join("");
      at = end.index + end[0].length;
      fence.lastIndex = at;
    }
    out.push(blocks(text.slice(at)));
    return out.join("");
  }

  return { render, escape };
})();
