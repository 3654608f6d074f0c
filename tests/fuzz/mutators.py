"""Mutations of origami's inputs: JSON documents (by value, type and structure, then as text), binary
files (safetensors shards, Megatron .idx/.bin), and short strings (--layout, blends, numeric flags).

Every mutation is a function of a random.Random, so a case is reproduced by its seed alone. Each one
returns a short description ("num_hidden_layers: 2 -> 2147483648") that goes into the case's report,
and the integers it wrote are recorded (Mutation.numbers) so that the outcome check can recognise a
value that came back wrapped to 32 or 64 bits in an error message.
"""
import json
import math
import struct

# Numbers that break size arithmetic: int32 and int64 edges, 2^61 (x 8 bytes or x 32 wraps int64),
# huge and tiny doubles, and the ones that become NaN or infinity in a parser that allows them.
INTERESTING_INTS = [0, -1, 1, 2, 3, 7, 255, 256, 257, 65535, 65536, 1000003, 10**7, 2**31 - 1, 2**31, -2**31,
                    2**31 + 1, 2**32, 2**32 + 1, 10**9, 10**12, 2**53, 2**53 + 1, 2**61, 2**62, 2**63 - 1, 2**63,
                    -2**63, 2**64 - 1, 2**64, 10**18, 10**30]
INTERESTING_FLOATS = [0.0, -0.0, 0.5, 1.5, -1.5, 1e-300, 5e-324, 1e300, -1e300, 1.7976931348623157e308,
                      2.0**31, 2.0**61, 1e19, 3.5e38]
# Written into the text as they are: not all are valid JSON (a parse error is an outcome to check too).
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0", "00", "0x10", "+1", ".5", "1.",
               "9" * 400, "1E+400", "2e9", "4294967296.5", "-9223372036854775809", "18446744073709551616"]
INTERESTING_STRINGS = ["", " ", "0", "-1", "1e999", "nan", "null", "true", "\u0000", "\u00ff\u00fe", "\ud7ff",
                       "../../../../etc/passwd", "/dev/zero", "/", ".", "%s%s%n", "\\", "\"", "a" * 300,
                       "\u202e\u0301", "😀" * 50, "step-1", "F32", "BF16", "I64", "U8", "weight", "exp_avg"]


class Raw(str):
    """Text written into the JSON as it is (NaN, 1e999, 0x10, ...)."""


class Obj(list):
    """A JSON object as a list of [key, value] pairs, so that a key can appear twice."""


def load_json(text):
    return json.loads(text, object_pairs_hook=lambda pairs: Obj([list(kv) for kv in pairs]))


def dump_json(v, indent=None, _level=0):
    """JSON text of a value built of Obj, list, str, int, float, bool, None and Raw."""
    nl = "" if indent is None else "\n" + " " * (indent * (_level + 1))
    end = "" if indent is None else "\n" + " " * (indent * _level)
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, Obj):
        if not v:
            return "{}"
        return "{" + ",".join(nl + json.dumps(k, ensure_ascii=False) + ": " + dump_json(x, indent, _level + 1)
                              for k, x in v) + end + "}"
    if isinstance(v, list):
        if not v:
            return "[]"
        return "[" + ",".join(nl + dump_json(x, indent, _level + 1) for x in v) + end + "]"
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "1e999" if v > 0 else "-1e999"
        return repr(v)
    raise TypeError(type(v))


class Mutation:
    """What one case changed: descriptions and the integers written."""

    def __init__(self):
        self.notes = []
        self.numbers = []
        self.fields = []  # names of the fields touched (for grouping hangs)

    def note(self, text, field=None):
        self.notes.append(text)
        if field is not None:
            self.fields.append(str(field))

    def describe(self):
        return "; ".join(self.notes)


def short(v, n=60):
    s = dump_json(v) if not isinstance(v, (bytes, bytearray)) else repr(bytes(v))
    return s if len(s) <= n else s[:n] + "...(%d chars)" % len(s)


def interesting_number(rng, old=None, m=None):
    r = rng.random()
    if r < 0.55:
        v = rng.choice(INTERESTING_INTS)
    elif r < 0.7:
        v = rng.choice(INTERESTING_FLOATS)
    elif r < 0.8:
        v = Raw(rng.choice(RAW_NUMBERS))
    elif isinstance(old, (int, float)) and not isinstance(old, bool):
        # around the old value: scaled by a power of two, negated, off by one
        op = rng.randrange(4)
        if isinstance(old, int):
            v = [old << rng.choice([8, 16, 31, 32, 40, 58]), -old, old + 1, old - 1][op]
        else:
            v = [old * 2.0**rng.choice([64, 512, 1000]), -old, old + 1, old / 1e300][op]
    else:
        v = rng.choice(INTERESTING_INTS)
    if m is not None and isinstance(v, int) and not isinstance(v, bool):
        m.numbers.append(v)
    return v


def other_type(rng, old):
    """The value as another JSON type."""
    choices = [None, True, False, "", [], Obj(), 0, "1"]
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        choices += [str(old), [old], Obj([["value", old]]), str(old) + "x"]
    elif isinstance(old, str):
        choices += [len(old), [old], Obj([[old, old]]), 1.5, -1]
    elif isinstance(old, list):
        choices += [len(old), Obj([[str(i), x] for i, x in enumerate(old[:4])]), dump_json(old)[:100]]
    elif isinstance(old, Obj):
        choices += [[x for _, x in old[:4]], len(old), "object"]
    return rng.choice(choices)


def nested(depth):
    return Raw("[" * depth + "]" * depth)


def walk(v, path=()):
    """Every (container, key, value, path) under v; the root has container None."""
    yield None, None, v, path
    if isinstance(v, Obj):
        for i, (k, x) in enumerate(v):
            yield from _walk_child(v, i, x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _walk_child(v, i, x, path + (i,))


def _walk_child(container, i, x, path):
    for c, k, y, p in walk(x, path):
        yield (container, i, y, p) if c is None else (c, k, y, p)


def _set(container, key, value):
    if isinstance(container, Obj):
        container[key][1] = value
    else:
        container[key] = value


def path_str(p):
    return ".".join(str(x) for x in p) or "(root)"


def mutate_value(rng, root, m, keys=(), strings=()):
    """One structural mutation of the document `root` (changed in place; returns the new root).
    keys: field names known for this kind of file (a missing one may be added); strings: string values
    seen in the seeds of this kind (a valid enum from another file reaches deeper code)."""
    nodes = list(walk(root))
    # Numbers are what broke things so far: they get most of the picks.
    weights = [6 if isinstance(v, (int, float)) and not isinstance(v, bool) else 2 if isinstance(v, str) else 1
               for _, _, v, _ in nodes]
    container, key, old, path = rng.choices(nodes, weights)[0]
    name = path[-1] if path else "(root)"
    op = rng.random()
    if container is None:  # the root itself
        new = rng.choice([Obj(), [], None, 0, "", [root], nested(rng.choice([64, 10000, 200000]))])
        m.note("whole document -> %s" % short(new), name)
        return new
    if op < 0.40 and isinstance(old, (int, float)) and not isinstance(old, bool):
        new = interesting_number(rng, old, m)
    elif op < 0.40 and isinstance(old, str):
        r = rng.random()
        if r < 0.4 and strings:
            new = rng.choice(strings)
        elif r < 0.7:
            new = rng.choice(INTERESTING_STRINGS)
        elif r < 0.85:
            new = old * rng.choice([2, 100, 5000]) if old else "x" * 100000
        else:
            new = old[: rng.randrange(len(old) + 1)]
    elif op < 0.55:
        new = other_type(rng, old)
    elif op < 0.67:
        del container[key]
        m.note("%s deleted (was %s)" % (path_str(path), short(old)), name)
        return root
    elif op < 0.77 and isinstance(container, Obj):
        k = container[key][0]
        dup = interesting_number(rng, old, m) if rng.random() < 0.5 else other_type(rng, old)
        container.insert(key + rng.choice([0, 1]), [k, dup])
        m.note("%s duplicated with %s" % (path_str(path), short(dup)), name)
        return root
    elif op < 0.77:
        copies = rng.choice([1, 2, 100, 3000])
        for _ in range(copies):
            container.insert(key, old)
        m.note("%s repeated %d more times" % (path_str(path), copies), name)
        return root
    elif op < 0.87 and isinstance(container, Obj) and keys:
        k = rng.choice(keys)
        v = interesting_number(rng, None, m) if rng.random() < 0.6 else other_type(rng, 1)
        container.append([k, v])
        m.note("%s.%s added = %s" % (path_str(path[:-1]), k, short(v)), k)
        return root
    elif op < 0.93:
        new = nested(rng.choice([3, 100, 100000]))
    else:
        new = rng.choice([[old] * rng.choice([2, 1000]), [], Obj(), Raw("[" + dump_json(old) + "," * 3 + "]")])
    _set(container, key, new)
    m.note("%s: %s -> %s" % (path_str(path), short(old), short(new)), name)
    return root


def mutate_text(rng, data, m):
    """A text-level mutation of serialized bytes: truncation, flipped bytes, an inserted token."""
    r = rng.random()
    if not data:
        return b"{"
    if r < 0.3:
        cut = rng.randrange(len(data))
        m.note("truncated to %d of %d bytes" % (cut, len(data)))
        return data[:cut]
    if r < 0.55:
        b = bytearray(data)
        for _ in range(rng.choice([1, 1, 2, 8])):
            i = rng.randrange(len(b))
            b[i] = rng.choice([b[i] ^ (1 << rng.randrange(8)), 0, 0xFF, ord('"'), ord("{"), ord("]"), ord(","), 0x80])
        m.note("bytes flipped")
        return bytes(b)
    if r < 0.8:
        i = rng.randrange(len(data))
        tok = rng.choice([b"NaN", b"1e999", b"-", b"\x00", b"\xc3", b"\xed\xa0\x80", b"//", b"\"", b",", b"}", b"9" * 50])
        m.note("inserted %r at byte %d" % (tok, i))
        return data[:i] + tok + data[i:]
    junk = rng.choice([b"", b"null", b"[]", b"{}", b"0", b"\"\"", b"\xef\xbb\xbf{}", b"\x00" * 64, b"[" * 100000])
    m.note("replaced by %r" % junk[:20])
    return junk


# A mutated file larger than this (stacked repetitions) only measures parsing speed: the mutation is drawn again.
MAX_BYTES = 4 << 20


def mutate_json_text(rng, text, m, keys=(), strings=(), indent=None):
    """1-3 value mutations, then (sometimes) a text mutation. Returns bytes."""
    for _ in range(5):
        try:
            root = load_json(text)
        except ValueError:
            return mutate_text(rng, text.encode(), m)
        notes = len(m.notes)
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            root = mutate_value(rng, root, m, keys, strings)
        data = dump_json(root, indent).encode("utf-8", "surrogatepass")
        if len(data) <= MAX_BYTES:
            break
        del m.notes[notes:]
    else:
        return mutate_text(rng, text.encode(), m)
    if rng.random() < 0.12:
        data = mutate_text(rng, data, m)
    return data


def json_vocabulary(texts):
    """(keys, strings) over the JSON documents `texts`: what mutate_value may add or swap in."""
    keys, strings = set(), set()
    for t in texts:
        try:
            root = load_json(t)
        except ValueError:
            continue
        for _, _, v, p in walk(root):
            if p and isinstance(p[-1], str):
                keys.add(p[-1])
            if isinstance(v, str) and len(v) < 64:
                strings.add(v)
    return sorted(keys), sorted(strings)


# ---- binary files

def flip_bytes(rng, data, m, lo=0, hi=None):
    b = bytearray(data)
    hi = len(b) if hi is None else hi
    if hi <= lo:
        return bytes(b)
    for _ in range(rng.choice([1, 2, 16])):
        i = rng.randrange(lo, hi)
        b[i] = rng.choice([b[i] ^ (1 << rng.randrange(8)), 0, 0xFF, 0x7F, 0x80])
    m.note("bytes flipped in [%d, %d)" % (lo, hi))
    return bytes(b)


def interesting_u64(rng, m, near=None):
    v = rng.choice([0, 1, 2, 7, 8, 2**31 - 1, 2**31, 2**32, 2**61, 2**63 - 1, 2**63, 2**64 - 1] +
                   ([near - 1, near + 1, near * 2, near + 8] if near else []))
    v %= 2**64
    m.numbers.append(v)
    return v


def mutate_safetensors(rng, data, m):
    """The 8-byte header length, the header JSON (value mutations), the data bytes, or the length of the file."""
    if len(data) < 8:
        return mutate_text(rng, data, m)
    (n,) = struct.unpack_from("<Q", data)
    r = rng.random()
    if r < 0.25:
        v = interesting_u64(rng, m, n)
        m.note("header length %d -> %d" % (n, v), "header_length")
        return struct.pack("<Q", v) + data[8:]
    if r < 0.7 and 8 + n <= len(data):
        header = data[8:8 + n].decode("utf-8", "replace")
        keys = ["dtype", "shape", "data_offsets", "__metadata__"]
        new = mutate_json_text(rng, header, m, keys, ["F32", "F16", "BF16", "I32", "I64", "F64", "U8", "BOOL", "F8_E4M3"])
        if rng.random() < 0.7 and len(new) <= n:
            new = new + b" " * (n - len(new))  # the same length: the data stays where it was
        return struct.pack("<Q", len(new)) + new + data[8 + n:]
    if r < 0.85:
        return flip_bytes(rng, data, m, min(8 + n, len(data)) if rng.random() < 0.5 else 8, len(data))
    cut = rng.choice([rng.randrange(len(data)), len(data) - 1, 8 + n // 2, 7])
    if rng.random() < 0.5:
        m.note("truncated to %d of %d bytes" % (cut, len(data)))
        return data[:max(cut, 0)]
    m.note("%d bytes appended" % 64)
    return data + b"\0" * 64


# Megatron .idx: magic, version u64, dtype u8, sequences u64, documents u64, sizes int32[S],
# pointers int64[S], document indices int64[D].
IDX_HEADER = 9 + 8 + 1 + 8 + 8


def mutate_idx(rng, data, m):
    if len(data) < IDX_HEADER:
        return mutate_text(rng, data, m)
    S, D = struct.unpack_from("<QQ", data, 18)
    b = bytearray(data)
    r = rng.random()
    fields = [("version", 9, "<Q"), ("sequences", 18, "<Q"), ("documents", 26, "<Q")]
    if r < 0.1:
        v = rng.choice([0, 2, 4, 5, 6, 7, 8, 9, 255])
        m.note("dtype code %d -> %d" % (b[17], v), "dtype")
        b[17] = v
    elif r < 0.4:
        name, off, fmt = rng.choice(fields)
        v = interesting_u64(rng, m, struct.unpack_from(fmt, b, off)[0])
        m.note("%s -> %d" % (name, v), name)
        struct.pack_into(fmt, b, off, v)
    elif r < 0.75 and S > 0:
        part = rng.choice(["size", "pointer", "document"])
        if part == "size":
            i = rng.randrange(S)
            v = rng.choice([0, -1, 1, 2**31 - 1, -2**31, 1 << 20])
            struct.pack_into("<i", b, IDX_HEADER + 4 * i, v)
        elif part == "pointer":
            i = rng.randrange(S)
            v = rng.choice([0, -1, -2**63, 2**63 - 1, 1, 2**40, 7])
            struct.pack_into("<q", b, IDX_HEADER + 4 * S + 8 * i, v)
        else:
            i = rng.randrange(max(D, 1))
            v = rng.choice([0, -1, S + 1, S, 2**62, -2**63])
            if IDX_HEADER + 12 * S + 8 * i + 8 <= len(b):
                struct.pack_into("<q", b, IDX_HEADER + 12 * S + 8 * i, v)
        m.numbers.append(v)
        m.note("%s %d -> %d" % (part, i, v), part)
    elif r < 0.9:
        return flip_bytes(rng, data, m)
    else:
        cut = rng.randrange(len(data))
        m.note("truncated to %d of %d bytes" % (cut, len(data)))
        return data[:cut]
    return bytes(b)


def mutate_bytes(rng, data, m):
    """Any file: flips, truncation, growth."""
    r = rng.random()
    if r < 0.5 and data:
        return flip_bytes(rng, data, m)
    if r < 0.8 and data:
        cut = rng.randrange(len(data))
        m.note("truncated to %d of %d bytes" % (cut, len(data)))
        return data[:cut]
    extra = rng.choice([b"\0" * 7, b"\xff" * 4096, data[:64]])
    m.note("%d bytes appended" % len(extra))
    return data + extra


# ---- words

def mutate_words(rng, words, pool, m):
    """A list of words (a --layout string, a blend): replace, drop, duplicate, add from `pool`, or garble one."""
    words = list(words)
    for _ in range(rng.choice([1, 1, 2, 3])):
        r = rng.random()
        if r < 0.35 or not words:
            w = rng.choice(pool)()
            words.insert(rng.randrange(len(words) + 1), w)
            m.note("word added: %r" % w[:60])
        elif r < 0.55:
            i = rng.randrange(len(words))
            m.note("word %r dropped" % words[i][:60])
            del words[i]
        elif r < 0.7:
            i = rng.randrange(len(words))
            words.insert(i, words[i])
            m.note("word %r duplicated" % words[i][:60])
        else:
            i = rng.randrange(len(words))
            w = words[i]
            g = rng.choice([w.upper(), w + w, w[:-1], w + "\x00", " " + w, w.replace("=", "=="), w * 500, "\t", ""])
            words[i] = g
            m.note("word %r -> %r" % (w[:40], g[:40]))
    return words


def checksum_hex(data):
    """core/checksum.h's checksum of `data` (checkpoint metadata records it), so a mutated shard can be
    made to pass the check and reach the reader."""
    M = 2**64 - 1
    P1, P2, P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & M

    lanes = [0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63]
    full = len(data) // 32 * 32
    words = struct.unpack_from("<%dQ" % (full // 8), data)
    for j in range(0, len(words), 4):
        for i in range(4):
            lanes[i] = (rotl((lanes[i] + words[j + i] * P2) & M, 31) * P1) & M
    h = (rotl(lanes[0], 1) + rotl(lanes[1], 7) + rotl(lanes[2], 12) + rotl(lanes[3], 18)) & M
    h = ((h ^ len(data)) * P3) & M
    for c in data[full:]:
        h = (rotl(h ^ ((c * P1) & M), 11) * P2) & M
    h ^= h >> 33
    h = (h * P2) & M
    h ^= h >> 29
    return "%016x" % h
