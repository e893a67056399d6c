"""Commands printed so that they paste: every file name quoted, wrapped only between words."""

from __future__ import annotations

import shlex


def quote(word: str) -> str:
    """One shell word that is exactly `word`.

    Printable text is single-quoted (POSIX sh); a name with a control character (a newline) is
    written as bash's $'...' so that the command stays on one line and still names that file.
    """
    if word.isprintable():
        return shlex.quote(word)
    out = []
    for c in word:
        if c in ("'", "\\"):
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.append("".join(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogateescape")))
    return "$'" + "".join(out) + "'"


def command(*words: str) -> str:
    """A command line from its words, each quoted."""
    return " ".join(quote(w) for w in words)


def split_words(line: str) -> list[str]:
    """A command line cut at the spaces between its words: never inside quotes or $(...)."""
    words, word = [], []
    quote_char = ""
    depth = 0
    i = 0
    while i < len(line):
        c = line[i]
        if quote_char:
            word.append(c)
            if c == "\\" and quote_char != "'" and i + 1 < len(line):
                word.append(line[i + 1])
                i += 1
            elif c == quote_char[-1]:
                quote_char = ""
        elif c == "\\" and i + 1 < len(line):
            word += [c, line[i + 1]]
            i += 1
        elif c == "$" and line[i + 1 : i + 2] == "'":
            word += ["$", "'"]
            quote_char = "$'"
            i += 1
        elif c in "'\"":
            word.append(c)
            quote_char = c
        elif c == "$" and line[i + 1 : i + 2] == "(":
            word += ["$", "("]
            depth += 1
            i += 1
        elif c == ")" and depth:
            word.append(c)
            depth -= 1
        elif c == " " and not depth:
            if word:
                words.append("".join(word))
            word = []
        else:
            word.append(c)
        i += 1
    if word:
        words.append("".join(word))
    return words
