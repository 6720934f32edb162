"""Sentences that mix ASCII, accented Latin, CJK, emoji, code and repeated stop words: the
text the frontend's byte-level tokenizer is trained on and its detokenizer tests decode."""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? naïve café",
    "日本語のテキストです。 中文字符 🙂🚀 emoji",
    "def main():\n    return 42\n",
    "Stop here. STOP! The end is near; the end is here.",
]
