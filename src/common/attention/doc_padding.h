// The padded layout of packed documents for the attention backward (documents as ranges): every
// document of at least `min_length` tokens starts and ends on a kDocPadAlign-token boundary, and
// runs of shorter documents stay packed (a run starts on a boundary too, since whatever precedes
// it ends on one). On that layout no
// 128-row tile straddles a long document's edge, which is where the deterministic backward's turn
// chains pay for partial tiles; and because at most seq / min_length documents are long, the padded
// length has a bound known from seq alone (doc_padded_length_bound), so a layout built on the device
// needs no synchronisation. The scheduler model prices the layout with doc_padded_positions
// (bench/dq_model_sweep.cpp); build_doc_padded_mask builds the backward's padded mask with it
// (doc_padded_positions and doc_padded_ids on the host; on a device, the per-token scan
// doc_pad_token_step); DocPadStep is the layout as a scan of documents and doc_padded_tile_entry
// the tiles' real rows per token. Tested on the CPU (tests/cpp/test_doc_padding.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/host_device.h"

namespace sparsetrain {

inline constexpr int64_t kDocPadAlign = 128;

ST_HOST_DEVICE constexpr int64_t doc_pad_align(int64_t p) {  // p >= 0 up to a boundary
  return (p + kDocPadAlign - 1) / kDocPadAlign * kDocPadAlign;
}

// At most 2 paddings per long document (before and after it, each < kDocPadAlign tokens), plus the
// last one to a whole tile.
constexpr int64_t doc_padded_length_bound(int64_t seq, int64_t min_length) {
  return doc_pad_align(seq + (2 * (seq / min_length) + 1) * (kDocPadAlign - 1));
}

// The padded position of each of the seq tokens of one row of document ids (a document: a maximal
// run of equal ids), and the padded length (a multiple of kDocPadAlign) in *padded_length.
inline std::vector<int64_t> doc_padded_positions(const int32_t* ids, int64_t seq, int64_t min_length,
                                                 int64_t* padded_length) {
  std::vector<int64_t> pos(static_cast<size_t>(seq));
  int64_t next = 0;  // the next free padded position
  for (int64_t s = 0; s < seq;) {
    int64_t e = s;
    while (e < seq && ids[e] == ids[s]) ++e;
    const bool long_doc = e - s >= min_length;
    if (long_doc) next = doc_pad_align(next);
    for (int64_t i = s; i < e; ++i) pos[static_cast<size_t>(i)] = next++;
    if (long_doc) next = doc_pad_align(next);
    s = e;
  }
  *padded_length = doc_pad_align(next);
  return pos;
}

// The layout as a scan, for a build on the device without a serial walk over the documents. A
// document maps the next free padded position x to the one after it: a short one of L tokens
// x -> x + L, a long one x -> align(align(x) + L) = align(x) + align(L). Every composition of such
// maps is x -> align(x + a) + b or x -> x + b (align(m + y) = m + align(y) for m on a boundary),
// so the documents' steps form a monoid under doc_pad_then (identity: the default step). An
// exclusive scan of them gives each document its x, and it starts at align(x) if long, else at x;
// the whole scan applied to 0, aligned, is the padded length. Tested against doc_padded_positions
// with the steps combined in random tree orders.
struct DocPadStep {
  bool aligns = false;  // x -> align(x + a) + b; else x -> x + b
  int64_t a = 0, b = 0;
};

ST_HOST_DEVICE constexpr DocPadStep doc_pad_step(int64_t length, int64_t min_length) {
  return length >= min_length ? DocPadStep{true, 0, doc_pad_align(length)} : DocPadStep{false, 0, length};
}

ST_HOST_DEVICE constexpr int64_t doc_pad_apply(const DocPadStep& s, int64_t x) {
  return s.aligns ? doc_pad_align(x + s.a) + s.b : x + s.b;
}

// f, then g.
ST_HOST_DEVICE constexpr DocPadStep doc_pad_then(const DocPadStep& f, const DocPadStep& g) {
  if (!g.aligns) return DocPadStep{f.aligns, f.a, f.b + g.b};
  if (!f.aligns) return DocPadStep{true, f.b + g.a, g.b};
  return DocPadStep{true, f.a, doc_pad_align(f.b + g.a) + g.b};
}

// The same layout as a scan over tokens, the device build's form (a document's first and last
// token need only know whether it is long; the device build finds document lengths with a scan
// of their starts). Token t is the step x -> x + 1, preceded by an alignment where it starts a long
// document and followed by one where it ends it (a long document of one token, at min_length 1:
// both, x -> align(x) + kDocPadAlign, its document step). The exclusive scan of the steps applied
// to 0 is x; the token sits at doc_pad_token_position(x, starts_long). Tested against
// doc_padded_positions with the steps combined in random tree orders.
ST_HOST_DEVICE constexpr DocPadStep doc_pad_token_step(bool starts_long, bool ends_long) {
  constexpr DocPadStep kAlign{true, 0, 0}, kIdentity{}, kOne{false, 0, 1};
  return doc_pad_then(doc_pad_then(starts_long ? kAlign : kIdentity, kOne), ends_long ? kAlign : kIdentity);
}
ST_HOST_DEVICE constexpr int64_t doc_pad_token_position(int64_t x, bool starts_long) {
  return starts_long ? doc_pad_align(x) : x;
}

// Which tokens start and end a long document, for the token steps, without measuring documents:
// with starts[t] = the number of document starts at or before token t (an inclusive sum scan of
// doc_first_token), a document is long iff no other one starts within min_length tokens of its
// first token, i.e. starts[t + min_length - 1] == starts[t] (its last token: starts[t - min_length
// + 1] == starts[t]). A document is a maximal run of equal ids, so an id may come back later.
ST_HOST_DEVICE inline bool doc_first_token(const int32_t* ids, int64_t t) { return t == 0 || ids[t - 1] != ids[t]; }
ST_HOST_DEVICE inline bool doc_last_token(const int32_t* ids, int64_t seq, int64_t t) {
  return t + 1 == seq || ids[t + 1] != ids[t];
}
ST_HOST_DEVICE inline bool doc_token_starts_long(const int32_t* ids, const int32_t* starts, int64_t seq, int64_t t,
                                                 int64_t min_length) {
  return doc_first_token(ids, t) && t + min_length - 1 < seq && starts[t + min_length - 1] == starts[t];
}
ST_HOST_DEVICE inline bool doc_token_ends_long(const int32_t* ids, const int32_t* starts, int64_t seq, int64_t t,
                                               int64_t min_length) {
  return doc_last_token(ids, seq, t) && t - min_length + 1 >= 0 && starts[t - min_length + 1] == starts[t];
}

// The padded layout's tiles of tile_rows (a divisor of kDocPadAlign: the backward's 64-row q tiles,
// 128-key kv tiles) as the backward will address them: each holds real rows [start, start + rows)
// and then padding, never padding before real rows (a padding run ends on a kDocPadAlign boundary,
// so at a tile's end or past it). Written per real token, so a device build is one pass over the
// tokens after the scan: the token at a tile's first position gives the tile its start, the last
// real token of a tile (the next token elsewhere, or the tile ends) its row count. Tiles no token
// writes are all padding (rows 0, as initialised).
struct DocPaddedTile {
  int32_t start = 0, rows = 0;
};
ST_HOST_DEVICE inline void doc_padded_tile_entry(const int64_t* pos, int64_t seq, int64_t token, int64_t tile_rows,
                                                 DocPaddedTile* tiles) {
  const int64_t p = pos[token], tile = p / tile_rows;
  if (p % tile_rows == 0) tiles[tile].start = static_cast<int32_t>(token);
  const bool last = token + 1 == seq || pos[token + 1] != p + 1 || (p + 1) % tile_rows == 0;
  if (last) tiles[tile].rows = static_cast<int32_t>(p % tile_rows + 1);
}

inline std::vector<DocPaddedTile> doc_padded_tiles(const std::vector<int64_t>& pos, int64_t padded_length,
                                                   int64_t tile_rows) {
  std::vector<DocPaddedTile> tiles(static_cast<size_t>(padded_length / tile_rows));
  for (int64_t t = 0; t < int64_t(pos.size()); ++t)
    doc_padded_tile_entry(pos.data(), int64_t(pos.size()), t, tile_rows, tiles.data());
  return tiles;
}

// The document ids of the padded layout, the query side's and the key side's ([padded_length]),
// from the two sides' ids of the seq tokens (one position map `pos` for both, so they may differ:
// cu_seqlens gives each side its own id past the last document): a token keeps its ids at its
// padded position; a padding row gets the largest id of either side + 1 as a query and + 2 as a
// key, so it allows nothing and nothing allows it (ids below INT32_MAX - 1, as documents are
// counted). A document mask over these ids at the padded length, with positions mapped by pos
// (monotone, so kv <= q is kept), is the original mask (tested).
inline void doc_padded_ids(const int32_t* ids_q, const int32_t* ids_kv, int64_t seq, const std::vector<int64_t>& pos,
                           int64_t padded_length, std::vector<int32_t>* q_ids, std::vector<int32_t>* kv_ids) {
  int32_t max_id = -1;
  for (int64_t s = 0; s < seq; ++s) max_id = std::max({max_id, ids_q[s], ids_kv[s]});
  const int32_t pad_q = max_id + 1, pad_kv = max_id + 2;
  q_ids->assign(static_cast<size_t>(padded_length), pad_q);
  kv_ids->assign(static_cast<size_t>(padded_length), pad_kv);
  for (int64_t s = 0; s < seq; ++s) {
    (*q_ids)[static_cast<size_t>(pos[static_cast<size_t>(s)])] = ids_q[s];
    (*kv_ids)[static_cast<size_t>(pos[static_cast<size_t>(s)])] = ids_kv[s];
  }
}

}  // namespace sparsetrain
