"""The JavaScript that clawgym adds to a task page, as strings.

`INIT_SCRIPT` runs in every page before the page's own scripts and defines
`window.__clawgym`: starting an episode the way MiniWoB's own driver does
(`core.endEpisode(0)`, `Math.seedrandom(seed)`, `core.startEpisodeReal()`), reading the
page's reward globals, rendering the visible page, and finding elements by id. The reward
itself is never computed here: `state` reads `WOB_RAW_REWARD_GLOBAL` as the page set it.

Element ids are numbers handed out in document order the first time an element is seen
visible in an episode and kept for the rest of it, so an id in one observation still means
the same element in the next; a new episode starts numbering again from 1.
"""

from __future__ import annotations

INIT_SCRIPT = r"""
(() => {
  if (window.__clawgym) return;
  // Load-time randomness is fixed, so a freshly loaded page is the same every time; the
  // episode's own randomness comes from Math.seedrandom(seed) in start().
  let s = 0x2545f491;
  Math.random = function () {
    s = (s + 0x6d2b79f5) | 0;
    let t = Math.imul(s ^ (s >>> 15), 1 | s);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const SKIP_IDS = new Set(['reward-display', 'sync-task-cover', 'click-canvas', 'query']);
  const SKIP_TAGS = new Set(['SCRIPT', 'STYLE', 'HEAD', 'META', 'LINK', 'NOSCRIPT',
                             'TEMPLATE', 'BR', 'TITLE', 'OPTION', 'DEFS', 'CLIPPATH']);
  const TEXT_TYPES = new Set(['text', 'password', 'email', 'number', 'search', 'tel', 'url',
                              'date', 'time', 'datetime-local', 'month', 'week', '']);
  const cg = { episode: 0, next: 1, byId: new Map() };

  const clip = (text, n) => text.length > n ? text.slice(0, n - 1) + '…' : text;
  const squash = (text) => text.replace(/\s+/g, ' ').trim();

  function ownText(el) {
    let text = '';
    for (const child of el.childNodes) {
      if (child.nodeType === Node.TEXT_NODE) text += ' ' + child.data;
    }
    return clip(squash(text), 160);
  }

  function shown(el, rect, style) {
    return rect.width > 0 && rect.height > 0 && rect.right > 0 && rect.bottom > 0 &&
      style.visibility !== 'hidden' && style.opacity !== '0';
  }

  function attributes(el, style) {
    const a = {};
    if (el.id) a.id = el.id;
    const cls = typeof el.className === 'string' ? squash(el.className) : '';
    if (cls) a.class = clip(cls, 40);
    for (const name of ['type', 'name', 'placeholder', 'title', 'aria-label', 'alt', 'fill',
                        'for', 'href']) {
      const v = el.getAttribute(name);
      if (v) a[name] = clip(squash(v), 60);
    }
    if (el.tagName === 'IMG' && el.getAttribute('src')) {
      a.src = el.getAttribute('src').split('/').pop();
    }
    if (el instanceof HTMLInputElement) {
      if (el.type === 'checkbox' || el.type === 'radio') a.checked = el.checked;
      else a.value = clip(el.value, 120);
    } else if (el instanceof HTMLTextAreaElement) {
      a.value = clip(el.value, 2000);
    } else if (el instanceof HTMLSelectElement) {
      a.options = Array.from(el.options).map((o) => squash(o.text)).join(' | ');
      a.value = el.selectedIndex >= 0 ? squash(el.options[el.selectedIndex].text) : '';
    }
    if (el.disabled) a.disabled = true;
    if (el.isContentEditable && el.contentEditable === 'true') a.editable = true;
    if (el.style && el.style.backgroundColor) a.background = el.style.backgroundColor;
    if (document.activeElement === el && el !== document.body) a.focused = true;
    return a;
  }

  function idOf(el) {
    if (el.__clawgymEpisode !== cg.episode) {
      el.__clawgymEpisode = cg.episode;
      el.__clawgymId = cg.next++;
      cg.byId.set(el.__clawgymId, el);
    }
    return el.__clawgymId;
  }

  function walk(el, depth, out) {
    if (SKIP_TAGS.has(el.tagName.toUpperCase()) || SKIP_IDS.has(el.id)) return;
    const style = getComputedStyle(el);
    if (style.display === 'none') return;
    const isShown = shown(el, el.getBoundingClientRect(), style);
    if (isShown) {
      const text = el instanceof HTMLTextAreaElement ? '' : ownText(el);
      out.push([idOf(el), depth, el.tagName.toLowerCase(), text, attributes(el, style)]);
    }
    for (const child of el.children) walk(child, isShown ? depth + 1 : depth, out);
  }

  function newIds() {
    cg.episode += 1;
    cg.next = 1;
    cg.byId = new Map();
  }

  cg.start = async (seed, mode, maxMs) => {
    if (typeof core === 'undefined' || !core.cover_div) return 'the task page did not load';
    core.endEpisode(0);  // MiniWoB's force stop: ends a running episode, else does nothing
    Math.seedrandom(seed);
    core.setDataMode(mode);
    core.EPISODE_MAX_TIME = maxMs;
    newIds();
    core.startEpisodeReal();
    // A stray click on the sync screen after the episode ends must not start an
    // unseeded episode.
    core.cover_div.onclick = null;
    for (let i = 0; i < 200 && window.WOB_TASK_READY === false; i++) {
      await new Promise((r) => setTimeout(r, 10));
    }
    if (window.WOB_TASK_READY === false) return 'the task did not become ready';
    // Lay the new problem out and render a frame: the page fetches what it shows (images
    // of CSS `content`, say) as it paints.
    void document.body.offsetHeight;  // (no walk: ids are handed out when first seen)
    await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
    return null;
  };

  cg.state = () => ({
    done: !!WOB_DONE_GLOBAL,
    reward: Number(WOB_RAW_REWARD_GLOBAL),
    reason: WOB_REWARD_REASON === null || WOB_REWARD_REASON === undefined
      ? null : String(WOB_REWARD_REASON),
  });

  cg.utterance = () => {
    const u = core.getUtterance();
    return squash(typeof u === 'string' ? u : String(u.utterance));
  };

  // settle: 0 reads the page as it is, 1 first lets zero-delay timers run, 2 first waits
  // for a rendered frame as well.
  function imagesLoaded(ms) {
    const waiting = Array.from(document.images).filter((img) => !img.complete).map(
      (img) => new Promise((r) => {
        img.addEventListener('load', r, { once: true });
        img.addEventListener('error', r, { once: true });
      }));
    // (no stray timer in the page when nothing is loading)
    if (waiting.length === 0) return Promise.resolve();
    return Promise.race([Promise.all(waiting), new Promise((r) => setTimeout(r, ms))]);
  }

  // freshIds: forget the ids handed out so far this episode (none of which an agent has
  // seen), so numbering starts again from 1.
  cg.observe = async (settle, freshIds) => {
    if (settle >= 2) {
      await new Promise((r) => requestAnimationFrame(() => r()));
      await imagesLoaded(1000);
    }
    if (settle >= 1) await new Promise((r) => setTimeout(r, 0));
    if (freshIds) newIds();
    return snapshot();
  };

  function snapshot() {
    const nodes = [];
    walk(document.body, 0, nodes);
    return { state: cg.state(), utterance: cg.utterance(), nodes: nodes };
  }

  // start() and the first observation in one call: start() ends on a rendered frame, so
  // what remains is the images that frame asked for.
  cg.begin = async (seed, mode, maxMs) => {
    const problem = await cg.start(seed, mode, maxMs);
    if (problem) return { problem: problem };
    await imagesLoaded(1000);
    await new Promise((r) => setTimeout(r, 0));
    return { problem: null, view: snapshot() };
  };

  cg.element = (id) => {
    const el = cg.byId.get(id);
    return el && el.isConnected ? el : null;
  };

  cg.locate = (id) => {
    const el = cg.element(id);
    if (!el) return { error: `there is no element [${id}] on the page` };
    let rect = el.getBoundingClientRect();
    if (rect.bottom > innerHeight || rect.right > innerWidth || rect.top < 0 || rect.left < 0) {
      el.scrollIntoView({ block: 'nearest', inline: 'nearest' });
      rect = el.getBoundingClientRect();
    }
    if (!(rect.width > 0 && rect.height > 0)) {
      return { error: `element [${id}] is not visible` };
    }
    const tag = el.tagName.toLowerCase();
    const editable = el.isContentEditable || el instanceof HTMLTextAreaElement ||
      (el instanceof HTMLInputElement && TEXT_TYPES.has(el.type));
    return { ...visiblePoint(el, rect), tag, editable };
  };

  // The centre of an element, or if something covers the centre, the point nearest to it
  // on a grid over the element where the element itself would receive the click.
  function visiblePoint(el, rect) {
    const hits = (x, y) => {
      const top = document.elementFromPoint(x, y);
      return top !== null && (top === el || el.contains(top));
    };
    const cx = rect.left + rect.width / 2, cy = rect.top + rect.height / 2;
    if (hits(cx, cy)) return { x: cx, y: cy };
    let best = null;
    for (let i = 1; i < 8; i++) {
      for (let j = 1; j < 8; j++) {
        const x = rect.left + rect.width * i / 8, y = rect.top + rect.height * j / 8;
        const d = (x - cx) ** 2 + (y - cy) ** 2;
        if ((best === null || d < best.d) && hits(x, y)) best = { x, y, d };
      }
    }
    return best === null ? { x: cx, y: cy } : { x: best.x, y: best.y };
  }

  cg.select = (id, option) => {
    const el = cg.element(id);
    if (!el) return { error: `there is no element [${id}] on the page` };
    if (!(el instanceof HTMLSelectElement)) {
      return { error: `element [${id}] is a <${el.tagName.toLowerCase()}>, not a <select>` };
    }
    const wanted = squash(option);
    const options = Array.from(el.options);
    const match = options.find((o) => squash(o.text) === wanted) ||
      options.find((o) => o.value === option) ||
      options.find((o) => squash(o.text).toLowerCase() === wanted.toLowerCase());
    if (!match) {
      return { error: `element [${id}] has no option ${JSON.stringify(option)}; its options ` +
               `are: ${options.map((o) => JSON.stringify(squash(o.text))).join(', ')}` };
    }
    el.focus();
    el.value = match.value;
    el.dispatchEvent(new Event('input', { bubbles: true }));
    el.dispatchEvent(new Event('change', { bubbles: true }));
    return { chosen: squash(match.text) };
  };

  function scrollable(el) {
    for (let node = el; node && node !== document.body; node = node.parentElement) {
      const style = getComputedStyle(node);
      const canY = /(auto|scroll)/.test(style.overflowY) && node.scrollHeight > node.clientHeight;
      const canX = /(auto|scroll)/.test(style.overflowX) && node.scrollWidth > node.clientWidth;
      if (canX || canY) return node;
    }
    return document.scrollingElement || document.documentElement;
  }

  cg.scroll = (id, dx, dy) => {
    let target = document.scrollingElement || document.documentElement;
    if (id !== null) {
      const el = cg.element(id);
      if (!el) return { error: `there is no element [${id}] on the page` };
      target = scrollable(el);
    }
    const before = [target.scrollLeft, target.scrollTop];
    target.scrollBy({ left: dx, top: dy, behavior: 'instant' });
    return { moved: target.scrollLeft !== before[0] || target.scrollTop !== before[1] };
  };

  Object.defineProperty(window, '__clawgym', { value: cg, enumerable: false });
})();
"""
