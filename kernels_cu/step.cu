// step.cu: a small step's plan, verify and write in one launch (plan_verify_write).
//
// plan_verify_write_step<kScan> is plan.cu's plan_verify_step (no real-KV folds) with a
// tail: the block that leaves last, when every other block has read every record it
// checks, stamps the step's tokens itself. The step's violations, counters, plans and
// records are exactly those of plan_and_verify followed by write. A step has at most
// STEP_TOKENS input tokens here (the host refuses more), a thread of the block each:
//   1. every block loads its thread's token (slot, id, position and the expected ones)
//      at the start of the launch, beside the rows' inputs, and keeps it in shared memory:
//      the last block finds the step's tokens there;
//   2. a thread per write row checks the row's span and seed (write.cu's row_ok), takes
//      the chain's state after the seed record (published by the block that checked that
//      record, on plan.cu's small route; else it reads the record) and walks the row's
//      tokens in shared memory, leaving each token its link and the chain's previous
//      stored position: a row is a handful of tokens (decode, speculative steps), so the
//      walk is short and needs no scan;
//   3. every thread checks and stores its token; a slot written twice is stored by its
//      last write only (a shared table of the highest token index per slot), as in the
//      reference, where later rows and later tokens overwrite earlier ones.
// Without real-KV folds a record holds no K/V bytes (its fingerprint is 0), so it can be
// stamped before the forward writes the K/V: one launch for a whole decode step.
//
// Routes: the plan and its checks take plan.cu's routes (on the small route the tiles
// publish the rows' seed states for the tail: kSeeds); the tail (StepWrite, below) has
// one route, the steps above. write.cu gives it the write's arguments and input bits.
#include "plan.cu"
#include "write.cu"

namespace kvc {

inline constexpr i64 STEP_TOKENS = 256;  // tokens the tail takes: one per thread of the block (the launch bounds)

struct PlanVerifyWriteArgs {
    PlanArgs p;
    CheckArgs c;
    WriteArgs w;  // the write's: its plan is the plan's, its canary and log the check's (no folds, no tiles)
};

inline constexpr int STEP_TABLE = 2 * STEP_TOKENS;  // the last-write table: at most half full
inline constexpr u64 STEP_EMPTY = ~0ULL;

struct StepShared {
    i64 slot[STEP_TOKENS], token[STEP_TOKENS], position[STEP_TOKENS];
    i64 etok[STEP_TOKENS], epos[STEP_TOKENS];  // the expected inputs, or -1
    u64 link[STEP_TOKENS];      // the link token i stores
    i64 prev[STEP_TOKENS];      // the chain's previous stored position before token i
    int has_prev[STEP_TOKENS];  // whether there is one
    int row[STEP_TOKENS];       // token i's live write row, or -1
    u64 keys[STEP_TABLE];       // slot -> the highest token index that stores it
    int last[STEP_TABLE];
};

// Enters slot s stored by token i; returns the table index it took.
__device__ __forceinline__ int step_enter(StepShared& sh, i64 s, int i) {
    int h = (int)(splitmix64((u64)s) & (u64)(STEP_TABLE - 1));
    for (;;) {
        const u64 prev = atomicCAS(&sh.keys[h], STEP_EMPTY, (u64)s);
        if (prev == STEP_EMPTY || prev == (u64)s) {
            atomicMax(&sh.last[h], i);
            return h;
        }
        h = (h + 1) & (STEP_TABLE - 1);
    }
}

__device__ __forceinline__ StepShared& step_shared() {
    __shared__ StepShared sh;
    return sh;
}

template <bool kScan>
struct StepWrite {
    WriteArgs w;

    static constexpr bool kSeeds = true;  // the rows' seed states, from plan.cu's small route

    // The host passes at most STEP_TOKENS; a larger count leaves the tokens past the block
    // unread, and the rows that reach them out of range (reported, never read).
    __device__ __forceinline__ i64 avail() const { return w.avail < (i64)blockDim.x ? w.avail : (i64)blockDim.x; }

    struct Prefetched {
        i64 s, t, p, etok, epos;
    };

    // 1. This thread's token, loaded at the start of the launch (every block: which one
    // leaves last is not known yet) and kept in shared memory once the rows' inputs are in.
    __device__ __forceinline__ Prefetched prefetch() const {
        const i64 i = threadIdx.x;
        const bool in = i < avail();
        Prefetched f;
        f.s = in ? load_index(w.out_cache_loc, width_bit(w.widths, W_LOC), i) : -1;
        f.t = in ? load_index(w.input_ids, width_bit(w.widths, W_IDS), i) : 0;
        f.p = in ? load_index(w.positions, width_bit(w.widths, W_POS), i) : 0;
        f.etok = in && width_bit(w.widths, HAS_ETOK) ? load_index(w.exp_tokens, width_bit(w.widths, W_ETOK), i) : -1;
        f.epos = in && width_bit(w.widths, HAS_EPOS) ? load_index(w.exp_positions, width_bit(w.widths, W_EPOS), i)
                                                     : -1;
        return f;
    }

    __device__ __forceinline__ void stash(const Prefetched& f) const {
        StepShared& sh = step_shared();
        const int i = (int)threadIdx.x;
        sh.slot[i] = f.s;
        sh.token[i] = f.t;
        sh.position[i] = f.p;
        sh.etok[i] = f.etok;
        sh.epos[i] = f.epos;
    }

    // sm: the small route's rows, as the finish left them (nullptr on the block route).
    __device__ void last_block(const PlanArgs& p, const CheckArgs*, const SmallRows* sm) const {
        StepShared& sh = step_shared();
        const int i = (int)threadIdx.x;
        const i64 N = w.num_slots;
        i64* records = w.records;
        const i64 avail = this->avail();
        const bool in = i < avail;
        const i64 s = sh.slot[i], t = sh.token[i], ps = sh.position[i];
        const bool has_etok = width_bit(w.widths, HAS_ETOK), has_epos = width_bit(w.widths, HAS_EPOS);
        const bool check_pos = *w.position_check != 0;
        __threadfence();  // acquire the seeds and seed states other blocks published
        sh.row[i] = -1;
        for (int k = i; k < STEP_TABLE; k += blockDim.x) {
            sh.keys[k] = STEP_EMPTY;
            sh.last[k] = -1;
        }
        __syncthreads();
        // 2. A thread per row (rounds uniform over the block: the row violations are per warp).
        const i64 nrows = p.bs;
        for (i64 base = 0; base < nrows; base += blockDim.x) {
            const i64 r = base + i;
            i64 o0 = 0, o1 = 0, seed = -1, published = 0, x_pub = 0, pos_pub = 0;
            i64* st = p.sync + SYNC_SEEDS + r * SEED_WORDS;
            if (r < nrows) {
                if (sm != nullptr) {  // the small route: this block's finish left the row's span and seed here
                    o0 = r > 0 ? sm->wend[r - 1] : 0;
                    o1 = sm->wend[r];
                    seed = sm->wseed[r];
                } else {
                    o0 = __ldcg(w.offsets + r);
                    o1 = __ldcg(w.offsets + r + 1);
                    seed = __ldcg(w.seeds + r);
                }
                if (r < SMALL_ROWS) {
                    x_pub = __ldcg(st);
                    pos_pub = __ldcg(st + 1);
                    published = __ldcg(st + 2);
                }
                // A published seed state names its seed; a row whose seed record no check read
                // (its slot out of range or reserved, or a row with no tokens to write) takes the
                // one its tiles stored.
                if (seed == SEED_FROM_TILES) seed = published != 0 ? published - 1 : __ldcg(w.seeds + r);
            }
            const bool skip = seed == SEED_SKIP;  // the plan skipped (and counted) the row
            const bool span_bad = r < nrows && !skip && (o0 < 0 || o1 > avail || o1 < o0);
            const bool seed_bad = r < nrows && !skip && !span_bad && (seed < -1 || seed >= N);
            append_violation(w.ring, w.head, w.ring_capacity, span_bad || seed_bad, w.tag, span_bad ? -1 : seed,
                             -1, -1, -1, 0, 0, span_bad ? FAIL_INPUT_OUT_OF_RANGE : FAIL_SLOT_OUT_OF_RANGE, r, -1,
                             write_detail(-1, -1, o0, o1, avail));
            if (r < nrows && !skip && !span_bad && !seed_bad && o1 > o0) {
                u64 x = first_link<kScan>();
                int has = 0;
                i64 pos = 0;
                if (seed >= 0 && published != 0) {  // the state after the seed record its check read
                    x = (u64)x_pub;
                    has = 1;
                    pos = pos_pub;
                } else if (seed >= 0) {
                    const Record sr = load_record(records, seed);
                    x = next_link<kScan>(sr);
                    has = 1;
                    pos = sr.position;
                }
                for (i64 j = o0; j < o1; ++j) {
                    sh.row[j] = (int)r;
                    sh.link[j] = x;
                    sh.prev[j] = pos;
                    sh.has_prev[j] = has;
                    if (sh.slot[j] >= 0) {  // a negative slot is skipped: the chain does not advance
                        x = advance<kScan>(x, sh.token[j], sh.position[j]);
                        has = 1;
                        pos = sh.position[j];
                    }
                }
            }
            if (published != 0) st[2] = 0;  // read: zero for the next launch
        }
        __syncthreads();
        // 3. Each token: checks, then the store of its slot's last write.
        const int r = in ? sh.row[i] : -1;
        const bool stored = r >= 0 && s >= 0;
        const u64 link = stored ? sh.link[i] : 0;
        i64 bits = 0, etok = -1, epos = -1;
        if (stored) {
            if (check_pos && sh.has_prev[i]) {
                if (position_breaks(sh.prev[i], ps, epos)) bits |= FAIL_WRITE_POSITION;
            }
            if (has_etok) {
                etok = sh.etok[i];
                if (etok != -1 && etok != t) bits |= FAIL_WRITE_TOKEN;
            }
            if (has_epos && sh.epos[i] != -1) {
                epos = sh.epos[i];
                if (epos != ps) bits |= FAIL_WRITE_POSITION;
            }
            if (s >= N) bits |= FAIL_SLOT_OUT_OF_RANGE;
        }
        const bool store = stored && s < N;
        const int entry = store ? step_enter(sh, s, i) : 0;
        const int written = __syncthreads_count(store);  // also orders the table's entries before the reads
        const int skipped = __syncthreads_count(r >= 0 && s < 0);
        if (store && sh.last[entry] == i) {
            longlong2* rec = (longlong2*)(records + s * RECORD_WORDS);
            rec[0] = make_longlong2(t, ps);
            rec[1] = make_longlong2((i64)link, 0);  // no folds: the fingerprint is 0
        }
        const bool has = bits != 0;
        append_violation(w.ring, w.head, w.ring_capacity, has, w.tag, s, ps, t, etok, link, link, bits, r, epos,
                         write_detail(i, has && sh.has_prev[i] ? sh.prev[i] : -1, has ? w.offsets[r] : -1,
                                      has ? w.offsets[r + 1] : -1, avail));
        if (i == 0) {
            atomicAdd((u64*)(w.counters + CTR_KERNEL_RUNS), 1ULL);  // the write's run
            if (written != 0) atomicAdd((u64*)(w.counters + CTR_SLOTS_WRITTEN), (u64)written);
            if (skipped != 0) atomicAdd((u64*)(w.counters + CTR_TOKENS_SKIPPED), (u64)skipped);
        }
    }
};

// kScan for a scan-chain canary.
template <bool kScan>
__global__ void __launch_bounds__(256, 3) plan_verify_write_step(PlanVerifyWriteArgs a) {
    plan_body<true, false, kScan>(a.p, &a.c, StepWrite<kScan>{a.w});
}

}  // namespace kvc
