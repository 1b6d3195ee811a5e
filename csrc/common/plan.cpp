#include "common/plan.h"

#include <utility>

#include "common/ggml_types.h"

namespace minfer {

namespace {

constexpr uint8_t R = SLOT_READ, W = SLOT_WRITE, RO = SLOT_READ | SLOT_OPTIONAL;

// Indexed by op code; entries with a null name are holes in the numbering.
const OpFormat* table(int32_t op) {
    static const OpFormat fmt[] = {
        {nullptr, {}, {}},
        {"add", {"output", "input", "input"}, {W, R, R}},
        {"mul", {"output", "input", "input"}, {W, R, R}},
        {"silu", {"output", "input"}, {W, R}},
        {"swiglu", {"output", "input", "input"}, {W, R, R}},
        {"rms_norm", {"output", "input"}, {W, R}},
        {"qk_norm", {"output", "input"}, {W, R}},
        {"matmul", {"output", "input"}, {W, R}},
        {"get_rows_w", {"output", "ids"}, {W, R}},
        {"get_rows", {"output", "input", "ids"}, {W, R, R}},
        {"rope", {"output", "input", "positions"}, {W, R, R}},
        {"kv_store", {"K region", "k", "v", "cells", "V region"}, {W, R, R, R, W}},
        {"attn", {"output", "q", "K region", "V region", "positions", "span"}, {W, R, R, R, R, RO}},
        {"sigmoid", {"output", "input"}, {W, R}},
        {"moe_topk", {"ids", "logits"}, {W, R}},
        {"moe_weights", {"weights", "logits"}, {W, R}},
        {"matmul_id", {"output", "input", "ids"}, {W, R, R}},
        {"moe_sum", {"output", "input", "weights"}, {W, R, R}},
        {"scale", {"output", "input"}, {W, R}},
        {"gelu", {"output", "input"}, {W, R}},
        {"geglu", {"output", "input", "input"}, {W, R, R}},
        {"softcap", {"output", "input"}, {W, R}},
        {"slice", {"output", "input"}, {W, R}},
    };
    if (op >= OP_ADD && op <= OP_LAST) return &fmt[op];
    return nullptr;
}

std::string dims(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

const Weight& need_weight(const Step& s, const WeightStore& ws, int slot) {
    if (s.w[slot] < 0 || s.w[slot] >= ws.count()) step_fail(s, "missing weight");
    return ws.get(s.w[slot]);
}

void f32_vector(const Step& s, const WeightStore& ws, int slot, int64_t n, const char* what) {
    if (s.w[slot] < 0) return;
    const Weight& w = ws.get(s.w[slot]);
    if (w.type != T_F32 || w.ne0 * w.ne1 != n)
        step_fail(s, std::string(what) + " " + w.name + " must be f32[" + std::to_string(n) + "]");
}

}  // namespace

const char* op_name(int32_t op) {
    const OpFormat* f = table(op);
    return f ? f->name : "?";
}

const OpFormat* op_format(int32_t op) { return table(op); }

void step_fail(const Step& s, const std::string& what) {
    throw std::invalid_argument(std::string("plan step ") + op_name(s.op) + " (node " + std::to_string(s.node) +
                                "): " + what);
}

void step_requirements(const Step& s, const WeightStore& ws, size_t need[8]) {
    const int64_t* ip = s.ip;
    for (int i = 0; i < 8; ++i) need[i] = 0;
    for (int i = 0; i < 8; ++i)
        if (ip[i] < 0) step_fail(s, "negative size field ip[" + std::to_string(i) + "]");
    auto set = [&](int slot, int64_t floats) { need[slot] = (size_t)floats * 4; };
    switch (s.op) {
        case OP_ADD: case OP_MUL: case OP_SWIGLU:
            for (int i = 0; i < 3; ++i) set(i, ip[0]);
            break;
        case OP_SILU:
            for (int i = 0; i < 2; ++i) set(i, ip[0]);
            break;
        case OP_RMS_NORM: case OP_QK_NORM:
            set(0, ip[0] * ip[1]);
            set(1, ip[0] * ip[1]);
            f32_vector(s, ws, 0, ip[0], "norm weight");
            break;
        case OP_MATMUL: {
            const Weight& w = need_weight(s, ws, 0);
            if (w.ne0 != ip[0] || w.ne1 != ip[1])
                step_fail(s, "weight " + w.name + " is " + dims(w.ne0, w.ne1) + ", node wants " + dims(ip[0], ip[1]));
            set(0, ip[1] * ip[2]);
            set(1, ip[0] * ip[2]);
            f32_vector(s, ws, 1, ip[1], "bias");
            break;
        }
        case OP_GET_ROWS_W: {
            const Weight& w = need_weight(s, ws, 0);
            if (w.ne0 != ip[0])
                step_fail(s, "table " + w.name + " rows are " + std::to_string(w.ne0) + " wide, node wants " +
                                 std::to_string(ip[0]));
            set(0, ip[0] * ip[1]);
            set(1, ip[1]);
            break;
        }
        case OP_GET_ROWS:
            set(0, ip[0] * ip[1]);
            set(1, ip[0] * ip[2]);
            set(2, ip[1]);
            break;
        case OP_ROPE:
            if (ip[3] > ip[2] || ip[3] % 2) step_fail(s, "n_rot must be even and <= head dim");
            if (ip[4] > 1) step_fail(s, "rope style must be 0 (neox) or 1 (normal)");
            f32_vector(s, ws, 0, ip[3] / 2, "rope factors");
            set(0, ip[0] * ip[1] * ip[2]);
            set(1, ip[0] * ip[1] * ip[2]);
            set(2, ip[0]);
            break;
        case OP_KV_STORE: {
            const size_t eb = kv_elem_bytes(ip[3]);
            if (!eb) step_fail(s, "KV element type " + std::to_string(ip[3]) + " is not f32 (0) or f16 (1)");
            need[0] = need[4] = (size_t)(ip[2] * ip[1]) * eb;
            set(1, ip[0] * ip[1]);
            set(2, ip[0] * ip[1]);
            set(3, ip[0]);
            break;
        }
        case OP_ATTN: {
            if (ip[2] <= 0 || ip[1] % ip[2]) step_fail(s, "head count must be a multiple of the KV head count");
            const size_t eb = kv_elem_bytes(ip[6]);
            if (!eb) step_fail(s, "KV element type " + std::to_string(ip[6]) + " is not f32 (0) or f16 (1)");
            if (!(s.fp[1] >= 0)) step_fail(s, "attention soft-cap must be >= 0");
            set(0, ip[0] * ip[1] * ip[3]);
            set(1, ip[0] > 0 ? (ip[0] - 1) * ip[5] + ip[1] * ip[3] : 0);
            need[2] = need[3] = (size_t)(ip[4] * ip[2] * ip[3]) * eb;
            set(4, ip[0]);
            if (s.buf[5] >= 0) set(5, ip[0] * 2);
            break;
        }
        case OP_SIGMOID:
            for (int i = 0; i < 2; ++i) set(i, ip[0]);
            break;
        case OP_SCALE: case OP_GELU: case OP_SOFTCAP:
            if (s.op == OP_SOFTCAP && !(s.fp[0] > 0)) step_fail(s, "soft-cap must be > 0");
            for (int i = 0; i < 2; ++i) set(i, ip[0]);
            break;
        case OP_GEGLU:
            for (int i = 0; i < 3; ++i) set(i, ip[0]);
            break;
        case OP_SLICE:
            if (ip[3] + ip[0] > ip[2]) step_fail(s, "slice columns run past the source row");
            set(0, ip[0] * ip[1]);
            set(1, ip[2] * ip[1]);
            break;
        case OP_MOE_TOPK: case OP_MOE_WEIGHTS:
            if (ip[1] < 1 || ip[1] > ip[0]) step_fail(s, "k must be in [1, n_expert]");
            if (s.op == OP_MOE_WEIGHTS && (ip[3] < 1 || ip[3] > 3 || ip[4] > 1))
                step_fail(s, "gating must be 1 (softmax), 2 (sigmoid) or 3 (softmax of the picked), norm 0 or 1");
            set(0, ip[1] * ip[2]);
            set(1, ip[0] * ip[2]);
            break;
        case OP_MATMUL_ID: {
            const Weight& w = need_weight(s, ws, 0);
            if (ip[3] < 1 || ip[4] < 1 || ip[4] > ip[3]) step_fail(s, "k must be in [1, n_expert]");
            if (w.ne0 != ip[0] || w.ne1 != ip[1] * ip[3])
                step_fail(s, "weight " + w.name + " is " + dims(w.ne0, w.ne1) + ", node wants " + std::to_string(ip[3]) +
                                 " experts of " + dims(ip[0], ip[1]));
            if (ip[2] != ip[5] && ip[2] != ip[5] * ip[4]) step_fail(s, "x_rows must be nt or nt * k");
            set(0, ip[1] * ip[4] * ip[5]);
            set(1, ip[0] * ip[2]);
            set(2, ip[4] * ip[5]);
            break;
        }
        case OP_MOE_SUM:
            set(0, ip[0] * ip[2]);
            set(1, ip[0] * ip[1] * ip[2]);
            set(2, ip[1] * ip[2]);
            break;
        default:
            if (table(s.op)) step_fail(s, "reserved op code with no field layout yet");
            step_fail(s, "unknown op code " + std::to_string(s.op));
    }
}

int WeightStore::add(Weight w) {
    size_t rb = type_row_bytes(w.type, w.ne0);
    if (rb == 0)
        throw std::invalid_argument("weight " + w.name + ": row length " + std::to_string(w.ne0) +
                                    " is not a whole number of blocks of type " + std::to_string(w.type));
    if (rb * (size_t)w.ne1 != w.nbytes)
        throw std::invalid_argument("weight " + w.name + ": " + std::to_string(w.nbytes) + " bytes, expected " +
                                    std::to_string(rb * (size_t)w.ne1));
    w.row_bytes = rb;
    ws_.push_back(std::move(w));
    return (int)ws_.size() - 1;
}

const Weight& WeightStore::get(int h) const {
    if (h < 0 || h >= (int)ws_.size()) throw std::out_of_range("unknown weight handle " + std::to_string(h));
    return ws_[h];
}

}  // namespace minfer
