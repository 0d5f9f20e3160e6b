# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""A max-flow solver for the dense, short layered graphs of attention flow (compiled).

The graph of one task (see ``attnflow._graph``): a source (an output position at layer
``T``), ``n`` tokens at each layer ``T-1 .. 1`` and one sink, the input token ``m``. Edges
run one layer down: from the source with capacities ``Ã_T[s, :]``, between layers with
``Ã_l``, and into the sink with the column ``Ã_1[:, m]``. Only the sink edges change from
one sink to the next, and only the source edges from one source to the next.

The solver is Dinic's: a blocking flow along shortest augmenting paths, then a new
breadth-first layering of the residual graph, until no path is left. It knows its target:
each (source, sink) pair comes with an upper bound ``U`` on its max-flow (cheap tree
bounds, computed by the caller), and the solver stops as soon as the flow reaches
``U - tolerance``: the max-flow then lies between the two and ``U`` is reported. Where the
bound is not reached, the solver tightens it once with the bottom-up tree bound of the sink
and otherwise runs to completion; the flow it then holds is the max-flow. Each later
layering is a breadth-first search that stops reading the arcs into a layer once every
live token of that layer has its level (on dense attention, after a few tokens), and gives
no level to tokens at the sink's distance or beyond, which lie on no shortest path.

Why this is fast on attention: the first layering is the graph's own layers (every path
from source to sink has ``T`` edges), so the first blocking flow needs no search, and the
arcs of every node are tried from the strongest down, so that most of the flow takes a few
wide paths. On real attention the first blocking flow nearly always reaches the bound.
Residuals, not flows, are stored, so that a saturated arc is exactly zero (a middle arc's
flow is its capacity less its residual); only the arcs that an augmentation touched are
reset between pairs, each write undone, the last first (the log keeps the residual each
write replaced): the arcs keep no copy of their capacities, which the matrices hold
(``Ã_{a+1}[tail, head]``, read where a backward arc or the bottom-up bound needs one).
The bottom-up bound skips the tokens that cannot reach the sink: they deliver exactly 0.

The middle layers are held as lists of arcs (`build_arcs`): each token's non-zero arcs,
contiguous, strongest first by powers of two (a counting sort, linear in the entries; the
order only guides the search, any order is exact); a head is a 16-bit token, and the
backward lists hold 32-bit arc ids relative to their matrix (at most 65,535 tokens).
Zero capacities take no memory, and a node's arcs are read in sequence. Tokens that cannot reach the current sink (outside the
interval of input tokens they reach; in causal attention every token before the sink)
are never entered; within a power of two heads descend, so where the tokens of a layer
reach no further as they descend (causal, banded) such arcs end the run and are skipped,
by the search, the breadth-first layerings and the bottom-up bound alike.

First blocking flows read the arcs of the lowest layers (``2 .. D + 1``) from dense
residual matrices, through bit sets of the tokens below that can still carry flow (64
blocked tokens skipped at once: near the sink, layer-1 tokens block as soon as their arc
into the sink fills), and a layer-2 token fans out into as many layer-1 tokens as the
path's bottleneck takes before the path is updated once. The current path keeps its
residuals and running minima and writes each arc back once, when it leaves the path.

Where every middle token's strongest arc is its own (attention with a residual of 0.5 or
more: ``0.5 + 0.5 A[k, k] >= 0.5 A[k, j]``), the self arcs leave the lists: they take the
last ``n (T-2)`` arc ids, token-major (token ``k``'s self arc in ``Ã_a`` is ``self_base +
k (T-2) + a - 2``), and each token tries its own first (current arc 0; list arc ``i - 1``
after it, then the backward arcs, which list self arcs too). In a first blocking flow half
of all advances are such straight descents: they now walk consecutive residuals of a block
that stays in cache instead of missing on the arc heads and residuals of large arrays. The
search order is unchanged where the self arc was first in its list anyway (strongest, the
largest head of its class: causal attention), and so are the values, to the last bit.

On graphs whose residuals outgrow the caches the search prefetches what it is about to
read: when a path leaves the source into a token, that token's first arc at every middle
layer (where most tokens' strongest arc is their own, as in causal attention with a
residual, first blocking flows run down it layer after layer); the dense row of a token a
path enters; the arcs a reset restores, a few ahead. Prefetches change no value.

On small graphs of local attention the pairs that first blocking flows leave are solved by
push-relabel on dense residuals instead (`solve_push_relabel`, at the end of this module).

Everything runs without the GIL: threads can solve tasks side by side.
"""

from libc.math cimport INFINITY
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset


cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil


cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    /* The empty volatile asm keeps the call: without it GCC finds a function of
       prefetches free of side effects (a prefetch writes nothing) and drops it. */
    #define ATTNFLOW_PREFETCH(p) \
        do { __builtin_prefetch((const void*)(p)); __asm__ __volatile__(""); } while (0)
    #else
    #define ATTNFLOW_PREFETCH(p) ((void)0)
    #endif
    """
    void _prefetch "ATTNFLOW_PREFETCH"(const void*) noexcept nogil


cdef enum:
    MAX_TOKENS = 65535  # tokens are unsigned shorts, and arc ids within a matrix below SELF_ARC
    N_BUCKETS = 64
    RESET_AHEAD = 16  # how far ahead `_reset` prefetches
    LARGE_BYTES = 16 << 20  # residuals from this size on are prefetched (beyond the caches)


cdef extern from *:
    """
    #define ATTNFLOW_SELF_ARC 0xFFFFFFFFu
    """
    const unsigned int SELF_ARC "ATTNFLOW_SELF_ARC"  # a backward list's entry for a self arc


cdef struct Work:
    # the graph
    int n_layers            # T
    int n                   # tokens per layer
    const double* cap       # Ã_1 .. Ã_T, (T, n, n): the source row is read here
    const double* sink_cols # Ã_1 transposed, (n, n): row m holds the capacities into sink m
    const long long* fwd_start  # (T-2, n+1): arcs of token j of matrix i are start[i, j] ..
    const unsigned short* arc_head  # (arcs,): the token each arc enters, one layer down
    const long long* bwd_start  # (T-2, n+1): arcs into token j of matrix i, strongest first
    const unsigned int* bwd_arc  # (arcs,): their arc ids, less their matrix's first
    const unsigned short* bwd_tail  # (arcs,): the token each one leaves, one layer up
    const int* bucket_end   # (T-2, n, N_BUCKETS): end of each strength class of a token's arcs
    const unsigned char* sorted_heads  # (T-2,): 1 where dead heads end their strength class
    int* bucket             # (nodes,): the strength class of each node's current arc
    const int* src_order    # (n,): the source row's columns, strongest first
    int src_count
    long long middle        # number of middle arcs: edge ids of source, sink edges follow
    # self arcs (token k of layer a to token k of layer a - 1) laid out token-major, apart
    # from the lists: edge `self_base + k (T-2) + a - 2`, tried first (see `build_arcs`)
    bint self_on
    long long self_base
    int source              # node ids: token j of layer a is (a-1) n + j, then source, sink
    int sink
    # the residual graph: edge e has forward residual res[e]; a middle edge's backward
    # residual is its capacity (in `cap`, by its tail and head) less res[e]
    const double* arc_cap   # (arcs,) or NULL: the capacities again, by arc (small graphs)
    double* res
    int* level
    int* cur
    int* path_node
    long long* path_edge
    char* path_forward
    double* path_value      # forward residual of each arc of the current path
    double* path_cap        # capacity of each arc back up of the current path
    double* path_min        # path_min[d]: the smallest of the first d (forward) residuals
    int* queue
    int* left               # (T + 1,): live tokens of each layer without a level yet
    double* deliverable     # bottom-up bound of one sink, per token of one layer (2 n)
    long long* log          # middle edges touched since the last reset
    double* log_old         # and the residual each had before (a reset restores them
    long long log_len       # in reverse: the capacities are not kept per arc)
    long long log_cap
    # reachability: token j of layer a reaches only input tokens in [lo, hi] (node ids)
    const int* reach_lo
    const int* reach_hi
    int m                   # the current sink (input token)
    # the arcs of layers 2 .. D + 1, dense (first blocking flows only): arc (j, k) of
    # Ã_a is edge `dense + (a-2) n² + j n + k`; the tokens of layers 1 .. D that may still
    # carry flow are set in `alive` (layer l's bits from word (l-1) W)
    bint dense_on
    bint large              # residuals beyond the caches: prefetches pay (see `_large`)
    bint prefetch_columns   # prefetch a source arc's token down the layers (see `_columnar`)
    int dense_layers        # D
    int words               # W, words of one layer's bits
    long long dense
    const int* dense_top    # (D, n): the largest k with Ã_a[j, k] > 0 (-1: none)
    unsigned long long* alive


cdef inline double _capacity(Work* w, int a, int tail, int head) noexcept nogil:
    """The capacity of the arc from token `tail` of layer ``a + 1`` into token `head` of `a`.

    ``Ã_{a+1}[tail, head]``, read from the matrices themselves: the arcs keep no copy.
    """
    return w.cap[<long long>a * w.n * w.n + <long long>tail * w.n + head]


cdef inline double _arc_capacity(
    Work* w, long long q, int a, int tail, int head
) noexcept nogil:
    """`_capacity` of arc `q`, from the arcs' own copy where there is one."""
    if w.arc_cap != NULL:
        return w.arc_cap[q]
    return _capacity(w, a, tail, head)


cdef inline bint _dead(Work* w, int v) noexcept nogil:
    """Whether token node `v` cannot reach the current sink (it never carries its flow)."""
    return w.m < w.reach_lo[v] or w.m > w.reach_hi[v]


cdef int _log_edge(Work* w, long long edge, double old) noexcept nogil:
    """Note that `edge`, whose residual was `old`, was written (`_reset` restores it)."""
    cdef long long* grown
    cdef double* grown_old
    if w.middle <= edge < w.dense:
        return 0  # source and sink edges are reset wholesale
    if w.log_len == w.log_cap:
        grown = <long long*>realloc(w.log, 2 * w.log_cap * sizeof(long long))
        if grown == NULL:
            return -1
        w.log = grown
        grown_old = <double*>realloc(w.log_old, 2 * w.log_cap * sizeof(double))
        if grown_old == NULL:
            return -1
        w.log_old = grown_old
        w.log_cap *= 2
    w.log[w.log_len] = edge
    w.log_old[w.log_len] = old
    w.log_len += 1
    return 0


cdef inline int _admissible_arc(
    Work* w, int u, bint backward, long long* edge, char* forward
) noexcept nogil:
    """Advance `u`'s current arc to the next admissible one; its head, or -1 if none is left."""
    cdef int n = w.n, a, j, k, i, nf, degree, v, b, off
    cdef int want = w.level[u] + 1
    cdef long long base, p, q
    cdef const unsigned short* heads
    cdef const int* ends
    cdef bint skip
    i = w.cur[u]
    if u == w.source:
        # Arcs into layer T-1, strongest first.
        base = <long long>(w.n_layers - 2) * n
        while i < w.src_count:
            k = w.src_order[i]
            if w.level[base + k] == want and w.res[w.middle + k] > 0.0:
                w.cur[u] = i
                edge[0] = w.middle + k
                forward[0] = 1
                if w.prefetch_columns:
                    _prefetch_column(w, k)
                return <int>(base + k)
            i += 1
        w.cur[u] = i
        return -1
    a = u // n + 1
    j = u - (a - 1) * n
    if w.dense_on and a <= w.dense_layers + 1 and a >= 2:
        return _admissible_dense(w, u, a, j, edge, forward)
    if a == 1:
        nf = 1
        if i == 0:
            if w.level[w.sink] == want and w.res[w.middle + n + j] > 0.0:
                edge[0] = w.middle + n + j
                forward[0] = 1
                return w.sink
            i = 1
    else:
        base = <long long>(a - 2) * n
        off = 0
        if w.self_on:
            # Current arc 0 is the self arc (a straight descent reads a small block of
            # residuals, token-major); list arc `i - 1` after it.
            off = 1
            if i == 0:
                v = <int>(base + j)
                q = w.self_base + <long long>j * (w.n_layers - 2) + a - 2
                if w.level[v] == want and w.res[q] > 0.0:
                    w.cur[u] = 0
                    edge[0] = q
                    forward[0] = 1
                    return v
                i = 1
        p = w.fwd_start[<long long>(a - 2) * (n + 1) + j]
        nf = <int>(w.fwd_start[<long long>(a - 2) * (n + 1) + j + 1] - p) + off
        heads = w.arc_head + p
        skip = w.sorted_heads[a - 2]
        ends = w.bucket_end + (<long long>(a - 2) * n + j) * N_BUCKETS
        while i < nf:
            v = <int>(base + heads[i - off])
            if w.level[v] == want and w.res[p + i - off] > 0.0:
                w.cur[u] = i
                edge[0] = p + i - off
                forward[0] = 1
                return v
            if skip and w.reach_hi[v] < w.m:
                # Heads descend within a strength class and reach no further as they
                # do: the rest of this class cannot reach the sink either.
                b = w.bucket[u]
                while ends[b] <= i - off:
                    b += 1
                w.bucket[u] = b
                i = ends[b] + off
                continue
            i += 1
    if backward and a <= w.n_layers - 2:
        # Arcs back up: the edges from tokens k of layer a + 1 into token j.
        p = w.bwd_start[<long long>(a - 1) * (n + 1) + j]
        degree = nf + <int>(w.bwd_start[<long long>(a - 1) * (n + 1) + j + 1] - p)
        while i < degree:
            v = a * n + w.bwd_tail[p + i - nf]
            q = _arc_id(w, a - 1, w.bwd_tail[p + i - nf], w.bwd_arc[p + i - nf])
            if w.level[v] == want and _arc_capacity(w, q, a, v - a * n, j) - w.res[q] > 0.0:
                w.cur[u] = i
                edge[0] = q
                forward[0] = 0
                return v
            i += 1
    w.cur[u] = i
    return -1


cdef inline long long _arc_id(Work* w, int i, int tail, unsigned int relative) noexcept nogil:
    """The arc id of a backward list entry of matrix `i` (see `build_backward_arcs`)."""
    if relative == SELF_ARC:
        return w.self_base + <long long>tail * (w.n_layers - 2) + i
    return w.fwd_start[<long long>i * (w.n + 1)] + relative


cdef bint _columnar(const long long* start, const unsigned short* head, int n) noexcept nogil:
    """Whether `_prefetch_column` pays: most tokens' strongest arc in ``Ã_2`` is their own.

    So in causal or banded attention with a residual; in bidirectional attention most
    strongest arcs lead to a few shared tokens, and the prefetched arcs would go unread.
    """
    cdef long long p
    cdef int j, own = 0, rows = 0
    for j in range(n):
        p = start[j]
        if start[j + 1] > p:
            rows += 1
            own += head[p] == j
    return 2 * own > rows


cdef inline void _prefetch_column(Work* w, int k) noexcept nogil:
    """Ask the memory for the first arc of token `k` at every middle layer, ahead of time.

    In a first blocking flow most paths from the source run down one token's strongest
    arc layer after layer (in causal attention with a residual, its self arc), and each
    of those arcs sits in its own place of a large array: fetched one after the other,
    every step of the descent waits for memory. Prefetches only: nothing is read here
    that the search would not read anyway, and a wrong guess costs a little bandwidth.
    """
    cdef int n = w.n, a, top
    cdef long long p, row
    if w.self_on:
        # The self arcs of token k, consecutive (a few cache lines).
        p = w.self_base + <long long>k * (w.n_layers - 2)
        for a in range(w.dense_layers, w.n_layers - 2, 8):
            _prefetch(w.res + p + a)
        _prefetch(w.res + p + w.n_layers - 3)
    else:
        for a in range(w.n_layers - 1, w.dense_layers + 1, -1):
            p = w.fwd_start[<long long>(a - 2) * (n + 1) + k]
            _prefetch(w.arc_head + p)
            _prefetch(w.res + p)
    for a in range(w.dense_layers + 1, 1, -1):
        top = w.dense_top[(a - 2) * n + k]
        if top >= 0:
            row = w.dense + (<long long>(a - 2) * n + k) * n
            _prefetch(w.res + row + top)


cdef inline void _prefetch_row(Work* w, int a, int k) noexcept nogil:
    """Prefetch the dense residual where token `k` of layer ``2 <= a <= D + 1`` reads next."""
    cdef int n = w.n, top = w.dense_top[(a - 2) * n + k]
    cdef int v = (a - 1) * n + k
    if top >= 0:
        _prefetch(w.res + w.dense + (<long long>(a - 2) * n + k) * n + top - w.cur[v])


cdef inline int _pop(Work* w, int i) noexcept nogil:
    """Write the residual of path arc `i`, kept on the path while it was there, back."""
    cdef long long edge = w.path_edge[i]
    cdef double old = w.res[edge]
    w.res[edge] = w.path_value[i]
    return _log_edge(w, edge, old)


cdef inline int _admissible_dense(
    Work* w, int u, int a, int j, long long* edge, char* forward
) noexcept nogil:
    """`_admissible_arc` for token `j` of layer ``2 <= a <= D + 1`` in a first blocking flow.

    Its arcs are read from the dense residuals of ``Ã_a``, heads descending, only into the
    tokens of layer ``a - 1`` still `alive` (a bit set: 64 dead or blocked tokens skipped at
    once). The current arc ``cur[u] = i`` stands for the head ``dense_top[a-2, j] - i``.
    """
    cdef int n = w.n, top = w.dense_top[(a - 2) * n + j], k, word
    cdef unsigned long long bits
    cdef long long first = w.dense + (<long long>(a - 2) * n + j) * n
    cdef const double* row = w.res + first
    cdef const unsigned long long* alive = w.alive + (a - 2) * w.words
    k = top - w.cur[u]
    while k >= 0:
        word = k >> 6
        if (k & 63) == 63:
            bits = alive[word]
        else:
            bits = alive[word] & ((<unsigned long long>2 << (k & 63)) - 1)
        while bits == 0:
            word -= 1
            if word < 0:
                break
            bits = alive[word]
        if bits == 0:
            break
        k = (word << 6) + 63 - __builtin_clzll(bits)
        if row[k] > 0.0:
            w.cur[u] = top - k
            edge[0] = first + k
            forward[0] = 1
            if a > 2 and w.large:
                # The path goes on from token k of layer a - 1: its dense row, where its
                # search resumes, is likely far from anything read lately.
                _prefetch_row(w, a - 1, k)
            return (a - 2) * n + k
        k -= 1
    w.cur[u] = top + 1
    return -1


cdef inline int _first_at_most(Work* w, int depth, double amount) noexcept nogil:
    """The first arc of the path whose residual is at most `amount`; `depth` if none."""
    cdef int lo = 1, hi = depth, mid
    if w.path_min[depth] > amount:
        return depth
    while lo < hi:  # path_min never increases: the first d with path_min[d] <= amount
        mid = (lo + hi) >> 1
        if w.path_min[mid] <= amount:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


cdef inline int _spend(Work* w, int depth, double amount) noexcept nogil:
    """Push `amount` along the (forward) path; return the first arc it fills (or `depth`).

    Subtraction rounds monotonically, so the running minima stay the minima of the
    updated residuals, and an arc is full exactly when its residual was at most `amount`.
    """
    cdef int i, cut = _first_at_most(w, depth, amount)
    cdef double* value = w.path_value
    cdef double* low = w.path_min
    for i in range(depth):
        value[i] -= amount
    for i in range(1, depth + 1):
        low[i] -= amount
    return cut


cdef inline void _block_first_layer(Work* w, int k) noexcept nogil:
    w.level[k] = -1
    w.alive[k >> 6] &= ~(<unsigned long long>1 << (k & 63))


cdef double _fan_out(Work* w, int u, int depth, double total, double target) noexcept nogil:
    """Send flow from layer-2 token `u` into the sink through layer-1 tokens; return it.

    At most what the path into `u` can still carry (its smallest residual), stopping once
    ``total + sent`` reaches `target`. Each step fills an arc into layer 1, the arc of that token into
    the sink (the token then blocks) or the path's bottleneck. -1 on memory failure.
    """
    cdef int n = w.n, j = u - n, k, i
    cdef long long edge, into_sink
    cdef char forward
    cdef double beta, sent = 0.0, d, r_arc, r_sink
    beta = w.path_min[depth]
    while beta - sent > 0.0 and total + sent < target:
        k = _admissible_dense(w, u, 2, j, &edge, &forward)
        if k < 0:
            break
        into_sink = w.middle + n + k
        r_sink = w.res[into_sink]
        if r_sink <= 0.0:
            _block_first_layer(w, k)
            continue
        r_arc = w.res[edge]
        d = beta - sent
        if r_arc < d:
            d = r_arc
        if r_sink < d:
            d = r_sink
        w.res[edge] = r_arc - d
        w.res[into_sink] = r_sink - d
        if _log_edge(w, edge, r_arc) < 0:
            return -1.0
        if sent + d == sent:
            break  # below rounding: the path is full
        sent += d
        if w.res[edge] <= 0.0:
            w.cur[u] += 1
        if w.res[into_sink] <= 0.0:
            _block_first_layer(w, k)
    return sent


cdef int _blocking_flow(
    Work* w, bint backward, double target, double* total
) noexcept nogil:
    """Augment along admissible arcs (``level + 1``) until blocked or `target` is reached.

    The arcs of the current path keep their residuals on the path (`path_value`, the
    forward residual ``res`` of each edge) and are written back when they leave it: an
    augmentation then touches a short local array instead of the graph, and each arc is
    written and logged once per visit instead of once per augmentation. The arithmetic
    is the same, so the residuals are the same to the last bit. No other arc of the level
    graph reads an arc of the path (every admissible arc goes one level down).
    """
    cdef int depth = 0, u, v, i, cut, a
    cdef long long edge
    cdef char forward
    cdef double bottleneck, r, sent
    w.path_node[0] = w.source
    w.path_min[0] = INFINITY
    while True:
        u = w.path_node[depth]
        if w.dense_on and w.n <= u < 2 * w.n:
            # A token of layer 2: send what the path brings into as many layer-1 tokens
            # as it takes, then update the path once (most augmentations end here).
            sent = _fan_out(w, u, depth, total[0], target)
            if sent < 0.0:
                return -1
            if sent > 0.0:
                total[0] += sent
                cut = _spend(w, depth, sent)
                if total[0] >= target:
                    for i in range(depth):
                        if _pop(w, i) < 0:
                            return -1
                    return 0
                if cut < depth:
                    for i in range(cut, depth):
                        if _pop(w, i) < 0:
                            return -1
                    depth = cut
                    continue
            # nothing left to send into: a dead end, below
        elif u == w.sink and not backward:
            # A forward path: the bottleneck is its running minimum.
            bottleneck = w.path_min[depth]
            cut = _spend(w, depth, bottleneck)
            total[0] += bottleneck
            if total[0] >= target:
                for i in range(depth):
                    if _pop(w, i) < 0:
                        return -1
                return 0
            for i in range(cut, depth):
                if _pop(w, i) < 0:
                    return -1
            depth = cut
            continue
        elif u == w.sink:
            bottleneck = 0.0
            for i in range(depth):
                if w.path_forward[i]:
                    r = w.path_value[i]
                else:
                    r = w.path_cap[i] - w.path_value[i]
                if i == 0 or r < bottleneck:
                    bottleneck = r
            cut = depth
            for i in range(depth):
                if w.path_forward[i]:
                    w.path_value[i] -= bottleneck
                    if w.path_value[i] <= 0.0 and cut == depth:
                        cut = i
                else:
                    w.path_value[i] += bottleneck
                    if w.path_cap[i] - w.path_value[i] <= 0.0 and cut == depth:
                        cut = i
            total[0] += bottleneck
            if total[0] >= target:
                for i in range(depth):
                    if _pop(w, i) < 0:
                        return -1
                return 0
            for i in range(cut, depth):
                if _pop(w, i) < 0:
                    return -1
            depth = cut  # retreat to the tail of the first saturated arc
            continue
        v = -1 if w.dense_on and w.n <= u < 2 * w.n else _admissible_arc(
            w, u, backward, &edge, &forward
        )
        if v >= 0:
            w.path_edge[depth] = edge
            w.path_forward[depth] = forward
            w.path_value[depth] = w.res[edge]
            if not forward:  # an arc back up, from token v of the layer above u's
                a = u // w.n + 1
                w.path_cap[depth] = _arc_capacity(w, edge, a, v - a * w.n, u - (a - 1) * w.n)
            if not backward:
                r = w.path_value[depth]
                w.path_min[depth + 1] = r if r < w.path_min[depth] else w.path_min[depth]
            depth += 1
            w.path_node[depth] = v
            continue
        w.level[u] = -1  # dead end for the rest of this phase
        if u < w.dense_layers * w.n:
            i = u % w.n
            w.alive[(u // w.n) * w.words + (i >> 6)] &= ~(<unsigned long long>1 << (i & 63))
        if depth == 0:
            return 0
        depth -= 1
        if _pop(w, depth) < 0:
            return -1
        w.cur[w.path_node[depth]] += 1


cdef bint _layer_residual_graph(Work* w) noexcept nogil:
    """Breadth-first levels from the source in the residual graph; False if no path.

    Each node's arcs are scanned forward first, then backward, in list order (the levels
    and the queue are those of a plain breadth-first search); the arcs into a layer are
    skipped once every live token of that layer has its level (`left` counts those still
    without one): on dense attention the layers fill after a few nodes, and the rest of
    a search reads only the arcs into layers that keep unreached tokens.
    """
    cdef int n = w.n, n_layers = w.n_layers, n_nodes = w.sink + 1
    cdef int head = 0, tail = 0, u, v, i, a, j, want, b = 0
    cdef int sink_level = -1
    cdef long long p, p_end, q, base, first = 0
    cdef const int* ends = NULL
    cdef bint skip
    cdef int* left = w.left
    for a in range(n_layers + 1):
        left[a] = 0
    for u in range(n_nodes):
        w.level[u] = -1
        w.cur[u] = 0
        w.bucket[u] = 0
    for u in range(w.source):
        if not _dead(w, u):
            left[u // n + 1] += 1
    w.level[w.source] = 0
    w.queue[tail] = w.source
    tail += 1
    while head < tail:
        u = w.queue[head]
        head += 1
        want = w.level[u] + 1
        if sink_level >= 0 and want > sink_level:
            break  # nodes this far never lie on a shortest path
        if u == w.source:
            base = <long long>(n_layers - 2) * n
            for i in range(w.src_count):
                if left[n_layers - 1] == 0:
                    break
                j = w.src_order[i]
                v = <int>(base + j)
                if w.level[v] < 0 and w.res[w.middle + j] > 0.0 and not _dead(w, v):
                    w.level[v] = want
                    w.queue[tail] = v
                    tail += 1
                    left[n_layers - 1] -= 1
            continue
        a = u // n + 1
        j = u - (a - 1) * n
        if a == 1:
            if sink_level < 0 and w.res[w.middle + n + j] > 0.0:
                w.level[w.sink] = want
                sink_level = want
        elif left[a - 1] > 0:
            # Forward arcs, into layer a - 1 (the self arc first, where it is apart).
            base = <long long>(a - 2) * n
            p = w.fwd_start[<long long>(a - 2) * (n + 1) + j]
            p_end = w.fwd_start[<long long>(a - 2) * (n + 1) + j + 1]
            if w.self_on:
                v = <int>(base + j)
                q = w.self_base + <long long>j * (n_layers - 2) + a - 2
                if w.level[v] < 0 and w.res[q] > 0.0 and not _dead(w, v):
                    w.level[v] = want
                    w.queue[tail] = v
                    tail += 1
                    left[a - 1] -= 1
                    if left[a - 1] == 0:
                        p = p_end
            # Heads sorted by reach, and the first token of layer a - 1 short of the sink:
            # a head that cannot reach it ends its strength class (as in the search).
            skip = w.sorted_heads[a - 2] and w.reach_hi[base] < w.m
            if skip:
                first = w.fwd_start[<long long>(a - 2) * (n + 1) + j]
                ends = w.bucket_end + (<long long>(a - 2) * n + j) * N_BUCKETS
                b = 0
            while p < p_end:
                v = <int>(base + w.arc_head[p])
                if w.level[v] < 0 and w.res[p] > 0.0 and not _dead(w, v):
                    w.level[v] = want
                    w.queue[tail] = v
                    tail += 1
                    left[a - 1] -= 1
                    if left[a - 1] == 0:
                        break
                elif skip and w.reach_hi[v] < w.m:
                    while ends[b] <= p - first:
                        b += 1
                    p = first + ends[b]
                    continue
                p += 1
        if a <= n_layers - 2 and left[a + 1] > 0:
            # Backward arcs: the edges from tokens of layer a + 1 into token j.
            p = w.bwd_start[<long long>(a - 1) * (n + 1) + j]
            p_end = w.bwd_start[<long long>(a - 1) * (n + 1) + j + 1]
            base = <long long>a * n
            while p < p_end:
                v = <int>(base + w.bwd_tail[p])
                q = _arc_id(w, a - 1, w.bwd_tail[p], w.bwd_arc[p])
                if (
                    w.level[v] < 0
                    and _arc_capacity(w, q, a, w.bwd_tail[p], j) - w.res[q] > 0.0
                    and not _dead(w, v)
                ):
                    w.level[v] = want
                    w.queue[tail] = v
                    tail += 1
                    left[a + 1] -= 1
                    if left[a + 1] == 0:
                        break
                p += 1
    # Tokens at the sink's level or beyond lie on no shortest path: no level, so that
    # blocking flows never enter them (the queue holds them last).
    while tail > 1 and sink_level >= 0 and w.level[w.queue[tail - 1]] >= sink_level:
        tail -= 1
        w.level[w.queue[tail]] = -1
    return sink_level >= 0


cdef void _layer_by_depth(Work* w) noexcept nogil:
    """The first layering: every source-sink path has ``T`` edges.

    Tokens that cannot reach the sink get no level: they are never entered.
    """
    cdef int n = w.n, a, j, v
    cdef unsigned long long* alive
    memset(w.alive, 0, w.dense_layers * w.words * sizeof(unsigned long long))
    for a in range(1, w.dense_layers + 1):
        alive = w.alive + (a - 1) * w.words
        for j in range(n):
            if not _dead(w, (a - 1) * n + j):
                alive[j >> 6] |= <unsigned long long>1 << (j & 63)
    for a in range(1, w.n_layers):
        for j in range(n):
            v = (a - 1) * n + j
            w.level[v] = -1 if _dead(w, v) else w.n_layers - a
            w.cur[v] = 0
            w.bucket[v] = 0
    w.level[w.source] = 0
    w.cur[w.source] = 0
    w.level[w.sink] = w.n_layers


cdef void _bottom_up(Work* w, int m) noexcept nogil:
    """``d_{T-1}``: what each token of layer ``T-1`` can deliver to sink `m`, tree-unfolded.

    ``d_1[j] = Ã_1[j, m]``, ``d_a[j] = Σ_k min(Ã_a[j, k], d_{a-1}[k])``, summed in the
    order of the arcs. A token that cannot reach `m` delivers exactly 0, and so adds
    exactly 0 to a sum: such tokens and the arcs into them are skipped (in causal
    attention every token before the sink, and within a strength class the rest of the
    class once a head is one of them), which changes no bit of the bound.
    """
    cdef int n = w.n, a, j, k, i, nl, b
    cdef long long p
    cdef double* below = w.deliverable
    cdef double* above = w.deliverable + n
    cdef double* swap
    cdef double s, c, d
    cdef const unsigned short* heads
    cdef const int* ends
    cdef const int* hi
    cdef bint skip
    for j in range(n):
        below[j] = w.sink_cols[<long long>m * n + j]
    for a in range(2, w.n_layers):
        skip = w.sorted_heads[a - 2]
        hi = w.reach_hi + <long long>(a - 2) * n  # of the heads, at layer a - 1
        for j in range(n):
            if _dead(w, (a - 1) * n + j):
                above[j] = 0.0
                continue
            p = w.fwd_start[(a - 2) * (<long long>n + 1) + j]
            nl = <int>(w.fwd_start[(a - 2) * (<long long>n + 1) + j + 1] - p)
            heads = w.arc_head + p
            ends = w.bucket_end + (<long long>(a - 2) * n + j) * N_BUCKETS
            s = 0.0
            if w.self_on:
                c = _arc_capacity(
                    w, w.self_base + <long long>j * (w.n_layers - 2) + a - 2, a - 1, j, j
                )
                d = below[j]
                s += c if c < d else d
            i = 0
            b = 0
            while i < nl:
                k = heads[i]
                if skip and hi[k] < m:
                    # Heads descend within a strength class: the rest of it is dead too.
                    while ends[b] <= i:
                        b += 1
                    i = ends[b]
                    continue
                c = _arc_capacity(w, p + i, a - 1, j, k)
                d = below[k]
                s += c if c < d else d
                i += 1
            above[j] = s
        swap = below
        below = above
        above = swap
    if below != w.deliverable:
        memcpy(w.deliverable, below, n * sizeof(double))


cdef void _reset(Work* w) noexcept nogil:
    """Give every middle edge an augmentation touched its capacity back.

    Each write is undone, the last first: an edge written several times gets back the
    residual it had before the first, its capacity.
    """
    cdef long long i
    for i in range(w.log_len - 1, -1, -1):
        if w.large and i >= RESET_AHEAD:
            # The logged arcs lie all over the residuals: ask for one a few steps ahead,
            # so that the misses overlap instead of coming one after the other.
            _prefetch(w.res + w.log[i - RESET_AHEAD])
        w.res[w.log[i]] = w.log_old[i]
    w.log_len = 0





def scan_layers(
    const double[:, :, ::1] mixed,
    int[:, ::1] reach_lo,
    int[:, ::1] reach_hi,
    long long[:, ::1] counts,
):
    """Reachability and arc counts in one pass over ``Ã_1 .. Ã_{T-1}``.

    `reach_lo`, `reach_hi` ``(T-1, n)``: the smallest and largest input token that token
    ``j`` of layer ``a`` reaches (``lo = n``, ``hi = -1`` for a token with no path down),
    ``lo_a[j] = min{lo_{a-1}[k] : Ã_a[j, k] > 0}`` with ``lo_0[k] = hi_0[k] = k``.
    `counts` ``(T-2, n)``: the non-zero entries of each row of ``Ã_2 .. Ã_{T-1}``.

    Returns whether every row of ``Ã_2 .. Ã_{T-1}`` with a non-zero entry has its largest
    on the diagonal (each middle token's self arc is its strongest: so with a residual
    of 0.5 or more on row-stochastic attention), when `build_arcs` may set self arcs apart.
    """
    cdef Py_ssize_t n_layers = mixed.shape[0], n = mixed.shape[2], a, j, k
    cdef int low, high, lo_k, hi_k
    cdef long long count
    cdef double strongest
    cdef bint self_strongest = True
    cdef const double* row
    cdef const int* below_lo
    cdef const int* below_hi
    if reach_lo.shape[0] != n_layers - 1 or counts.shape[0] != n_layers - 2:
        raise ValueError("`reach_lo` must be (T-1, n) and `counts` (T-2, n)")
    with nogil:
        for a in range(n_layers - 1):
            for j in range(n):
                row = &mixed[a, j, 0]
                low = <int>n
                high = -1
                count = 0
                strongest = 0.0
                for k in range(n):
                    if row[k] > 0.0:
                        count += 1
                        if row[k] > strongest:
                            strongest = row[k]
                        if a == 0:
                            lo_k = <int>k
                            hi_k = <int>k
                        else:
                            lo_k = reach_lo[a - 1, k]
                            hi_k = reach_hi[a - 1, k]
                        if lo_k < low:
                            low = lo_k
                        if hi_k > high:
                            high = hi_k
                reach_lo[a, j] = low
                reach_hi[a, j] = high
                if a > 0:
                    counts[a - 1, j] = count
                    if count > 0 and not row[j] >= strongest:
                        self_strongest = False
    return self_strongest


def build_arcs(
    const double[:, :, ::1] matrices,
    long long[:, ::1] start,
    unsigned short[::1] head,
    int[:, :, ::1] bucket_end,
    double[::1] residual=None,
    Py_ssize_t dense_layers=0,
    bint self_arcs=False,
    double[::1] capacity=None,
):
    """Each row's non-zero entries as arcs, strongest first by powers of two.

    Within a power of two, heads descend. `bucket_end` ``(L, n, 64)`` receives, for each
    row, where each power's arcs end (relative to the row's first arc).

    ``start`` ``(L, n+1)`` must hold, on entry, the global offset of each row's first arc
    (``start[l, j]``, with ``start[l, n]`` the next matrix's first); `head` has one slot
    per non-zero entry (the capacities are the matrices' own entries: the solver reads
    them there). A counting sort on the binary exponent (64 buckets,
    the last one for everything below ``2**-62``): linear in the entries.

    With `residual` (the solver's buffer, ``arcs + 2 n + D n²``, ``D = dense_layers``), the
    same pass writes the solver's starting residuals, each row while it is in cache: the
    arcs of matrices ``D ..`` at their capacities, and matrices ``0 .. D-1`` dense, row-major,
    in the last ``D n²``. The residuals of the arcs of matrices ``0 .. D-1`` are left
    unwritten: first blocking flows read those layers dense (see `solve`); a solve with
    backward arcs needs them written first (`fill_residuals`).

    With `self_arcs`, the diagonal (each token's arc to itself one layer down) is left out
    of the lists and goes to the last ``L n`` slots of `head`, token-major:
    the self arc of token ``j`` in matrix ``l`` is arc ``S + j L + l``, ``S`` the listed
    arcs (the start offsets then count the listed arcs alone); its starting residual is
    written whatever ``l``. The solver tries it first (`solve`'s `self_base`).

    With `capacity` (one slot per arc), each arc's capacity is copied there too (`solve`'s
    `arc_cap`: on small graphs a lookup by arc beats one in the matrices).
    """
    cdef Py_ssize_t n_mats = matrices.shape[0], n = matrices.shape[1], l, j, k
    cdef long long counts[N_BUCKETS]
    cdef long long place[N_BUCKETS]
    cdef int b, e
    cdef long long total, dense = 0, self_base = -1, q
    cdef double c
    cdef const double* row
    cdef double* res = NULL
    cdef double* cap = NULL
    cdef unsigned long long bits
    if capacity is not None:
        if capacity.shape[0] != head.shape[0]:
            raise ValueError("`capacity` must have one slot per arc, as `head`")
        if capacity.shape[0] > 0:
            cap = &capacity[0]
    if n > MAX_TOKENS:
        raise ValueError(f"the solver takes at most {MAX_TOKENS} tokens, not {n}")
    if residual is not None:
        if dense_layers < 0 or dense_layers > n_mats:
            raise ValueError("`dense_layers` must be between 0 and the number of matrices")
        dense = head.shape[0] + 2 * n
        if residual.shape[0] != dense + dense_layers * n * n:
            raise ValueError("`residual` must have one entry per arc, then 2 n, then D n²")
        res = &residual[0]
    if self_arcs:
        self_base = head.shape[0] - n_mats * n
        if self_base < 0 or (n_mats > 0 and start[n_mats - 1, n] != self_base):
            raise ValueError("`head` must have the listed arcs, then one self arc per row")
    with nogil:
        for l in range(n_mats):
            for j in range(n):
                row = &matrices[l, j, 0]
                if res != NULL and l < dense_layers:
                    memcpy(res + dense + (l * n + j) * n, row, n * sizeof(double))
                if self_base >= 0:
                    q = self_base + j * n_mats + l
                    head[q] = <unsigned short>j
                    if cap != NULL:
                        cap[q] = row[j]
                    if res != NULL:
                        res[q] = row[j]
                memset(counts, 0, sizeof(counts))
                for k in range(n):
                    c = row[k]
                    if c > 0.0 and (self_base < 0 or k != j):
                        memcpy(&bits, &c, sizeof(double))
                        e = <int>(bits >> 52)
                        b = 1023 - e + 1  # (0.5, 1] and above: bucket 0 or 1
                        if b < 0:
                            b = 0
                        elif b >= N_BUCKETS:
                            b = N_BUCKETS - 1
                        counts[b] += 1
                total = start[l, j]
                for b in range(N_BUCKETS):
                    place[b] = total
                    total += counts[b]
                    bucket_end[l, j, b] = <int>(total - start[l, j])
                for k in range(n - 1, -1, -1):
                    c = row[k]
                    if c > 0.0 and (self_base < 0 or k != j):
                        memcpy(&bits, &c, sizeof(double))
                        e = <int>(bits >> 52)
                        b = 1023 - e + 1
                        if b < 0:
                            b = 0
                        elif b >= N_BUCKETS:
                            b = N_BUCKETS - 1
                        head[place[b]] = <unsigned short>k
                        if cap != NULL:
                            cap[place[b]] = c
                        if res != NULL and l >= dense_layers:
                            res[place[b]] = c
                        place[b] += 1


def fill_residuals(
    const double[:, :, ::1] matrices,
    const long long[:, ::1] start,
    const unsigned short[::1] head,
    double[::1] residual,
    Py_ssize_t low,
    Py_ssize_t high,
    bint self_arcs=False,
):
    """Write the arcs of matrices ``low .. high-1`` at their capacities into `residual`.

    The arcs as `build_arcs` laid them out (with `self_arcs`, the self arcs of those
    matrices too): each row's arcs read their capacities from the row, in cache.
    """
    cdef Py_ssize_t n_mats = matrices.shape[0], n = matrices.shape[1], l, j
    cdef long long p, self_base = -1
    cdef const double* row
    cdef double* res = &residual[0]
    if not 0 <= low <= high <= n_mats or residual.shape[0] < head.shape[0]:
        raise ValueError("`low .. high` must be matrices, and `residual` hold every arc")
    if self_arcs:
        self_base = head.shape[0] - n_mats * n
    with nogil:
        for l in range(low, high):
            for j in range(n):
                row = &matrices[l, j, 0]
                for p in range(start[l, j], start[l, j + 1]):
                    res[p] = row[head[p]]
                if self_base >= 0:
                    res[self_base + j * n_mats + l] = row[j]


def build_backward_arcs(
    const long long[:, ::1] start,
    const unsigned short[::1] head,
    const unsigned char[:, ::1] keep,
    long long[:, ::1] bwd_start,
    unsigned int[::1] bwd_arc,
    unsigned short[::1] bwd_tail,
    long long self_base=-1,
):
    """The arcs into each token of each matrix, by a counting sort on their heads.

    Fills ``bwd_start`` ``(L, n+1)`` (arcs into token ``k`` of matrix ``i`` are
    ``bwd_start[i, k] .. bwd_start[i, k+1]``, within the matrix's global range of forward
    arcs), their arc ids `bwd_arc`, less the matrix's first (``start[i, 0]``; uint32:
    below ``n² < 2**32``), and the tokens they leave, `bwd_tail` (uint16). Only the arcs
    into tokens with ``keep[i, k]`` are listed (the others get none: the solver never
    enters a token that cannot reach the sink, so its backward arcs are never read).
    Linear in the arcs; only the kept ones are written.

    With `self_base` (arcs laid out by `build_arcs` with `self_arcs`), the self arcs
    ``self_base + j L + i`` are listed too, each where its tail puts it, as ``SELF_ARC``
    (``2**32 - 1``: the tail says which); matrix ``i``'s lists then begin at ``start[i, 0]
    + i n``.
    """
    cdef Py_ssize_t n_mats = start.shape[0], n = start.shape[1] - 1, i, j, k
    cdef long long p, total, first
    if n > MAX_TOKENS:
        raise ValueError(f"the solver takes at most {MAX_TOKENS} tokens, not {n}")
    with nogil:
        for i in range(n_mats):
            for k in range(n + 1):
                bwd_start[i, k] = 0
            for p in range(start[i, 0], start[i, n]):
                if keep[i, head[p]]:
                    bwd_start[i, head[p] + 1] += 1
            if self_base >= 0:
                for k in range(n):
                    if keep[i, k]:
                        bwd_start[i, k + 1] += 1
            first = start[i, 0] + (i * n if self_base >= 0 else 0)
            total = first
            for k in range(n + 1):
                total += bwd_start[i, k]
                bwd_start[i, k] = total
            # bwd_start[i, k] is now the end of token k - 1's arcs = the start of token k's
            for j in range(n):
                if self_base >= 0 and keep[i, j]:
                    bwd_arc[bwd_start[i, j]] = SELF_ARC
                    bwd_tail[bwd_start[i, j]] = <unsigned short>j
                    bwd_start[i, j] += 1
                for p in range(start[i, j], start[i, j + 1]):
                    k = head[p]
                    if not keep[i, k]:
                        continue
                    bwd_arc[bwd_start[i, k]] = <unsigned int>(p - start[i, 0])
                    bwd_tail[bwd_start[i, k]] = <unsigned short>j
                    bwd_start[i, k] += 1
            # each start advanced to its token's end, the next token's start: shift back
            for k in range(n, 0, -1):
                bwd_start[i, k] = bwd_start[i, k - 1]
            bwd_start[i, 0] = first


def solve(
    const double[:, :, ::1] mixed,
    const double[:, ::1] sink_columns,
    const long long[::1] rows,
    const long long[::1] sinks,
    const double[:, ::1] upper,
    const long long[:, ::1] fwd_start,
    const unsigned short[::1] arc_head,
    const long long[:, ::1] bwd_start,
    const unsigned int[::1] bwd_arc,
    const unsigned short[::1] bwd_tail,
    const int[:, :, ::1] bucket_end,
    const unsigned char[::1] sorted_heads,
    const int[:, ::1] dense_top,
    const int[:, ::1] src_order,
    const int[::1] src_count,
    const int[:, ::1] reach_lo,
    const int[:, ::1] reach_hi,
    bint with_backward,
    double tolerance,
    double[::1] residual,
    double[:, ::1] values,
    signed char[:, ::1] status,
    long long self_base=-1,
    const double[::1] arc_cap=None,
):
    """Max-flows from each of `rows` (layer ``T``) to each of `sinks`; see the module doc.

    `sink_columns` is ``Ã_1`` transposed (C-contiguous): row ``m`` holds the capacities
    into sink ``m``, copied whole for each pair. `values` receives the max-flows; `status` 1 where the flow reached the bound (the
    value is the bound), 2 where the solver ran to completion (the value is its flow).
    Without `with_backward` (`bwd_*` are then placeholders), a pair that needs more than
    the first blocking flow is left with status 3, to be solved again with them.
    Pairs with a zero bound are left alone (value 0, status 0). `residual` (``arcs + 2 n
    + D n²``) must hold each arc's capacity in its first ``arcs`` entries and ``Ã_2 .. Ã_{D+1}``
    (row-major) in its last ``D n²`` (those layers' arcs, dense, read by first blocking
    flows without `with_backward`; `dense_top` ``(D, n)`` is each row's last non-zero
    column, -1 for none); without `with_backward` the entries of the arcs of ``Ã_2 ..
    Ã_{D+1}`` are never read and may hold anything. It is given back so, every touched
    arc restored, so that one buffer serves call after call.
    """
    cdef int n_layers = mixed.shape[0], n = mixed.shape[2]
    cdef Py_ssize_t n_rows = rows.shape[0], n_sinks = sinks.shape[0]
    cdef Work w
    cdef long long middle = arc_head.shape[0]
    cdef int dense_layers = dense_top.shape[0]
    cdef long long n_edges = middle + 2 * n + dense_layers * <long long>n * n
    cdef int n_nodes = (n_layers - 1) * n + 2
    cdef Py_ssize_t ri, si, k
    cdef int s, m, failed = 0
    cdef double target, total, bound, c
    cdef bint refined
    cdef long long nn = <long long>n * n

    if n_layers < 3:
        raise ValueError("the kernel solves graphs of three or more layers")
    w.n_layers = n_layers
    w.n = n
    w.cap = &mixed[0, 0, 0]
    if sink_columns.shape[0] != n or sink_columns.shape[1] != n:
        raise ValueError("`sink_columns` must be Ã_1 transposed, (n, n)")
    w.sink_cols = &sink_columns[0, 0]
    w.fwd_start = &fwd_start[0, 0]
    w.arc_head = &arc_head[0] if middle > 0 else NULL
    w.bwd_start = &bwd_start[0, 0]
    w.bwd_arc = &bwd_arc[0] if bwd_arc.shape[0] > 0 else NULL
    w.bwd_tail = &bwd_tail[0] if bwd_tail.shape[0] > 0 else NULL
    w.reach_lo = &reach_lo[0, 0]
    w.bucket_end = &bucket_end[0, 0, 0]
    w.sorted_heads = &sorted_heads[0]
    w.dense = middle + 2 * n
    w.dense_on = dense_layers > 0 and not with_backward
    w.dense_top = &dense_top[0, 0] if dense_layers > 0 else NULL
    w.dense_layers = dense_layers
    w.words = (n + 63) >> 6
    if dense_layers > n_layers - 2:
        raise ValueError("`dense_top` must have at most T - 2 rows")
    w.reach_hi = &reach_hi[0, 0]
    w.middle = middle
    w.arc_cap = NULL
    if arc_cap is not None:
        if arc_cap.shape[0] != middle:
            raise ValueError("`arc_cap` must have one capacity per arc")
        if middle > 0:
            w.arc_cap = &arc_cap[0]
    w.self_on = self_base >= 0
    w.self_base = self_base
    if w.self_on and self_base + <long long>n * (n_layers - 2) != middle:
        raise ValueError("`self_base` must be where the last n (T-2) arcs, the self arcs, begin")
    w.source = (n_layers - 1) * n
    w.sink = w.source + 1
    w.large = n_edges * sizeof(double) >= LARGE_BYTES
    w.prefetch_columns = w.large and w.dense_on and (
        w.self_on or _columnar(&fwd_start[0, 0], w.arc_head, n)
    )
    if residual.shape[0] != n_edges:
        raise ValueError("`residual` must have one entry per arc, then 2 n, then D n²")
    w.res = &residual[0]
    w.level = <int*>malloc(n_nodes * sizeof(int))
    w.cur = <int*>malloc(n_nodes * sizeof(int))
    w.bucket = <int*>malloc(n_nodes * sizeof(int))
    w.alive = <unsigned long long*>malloc(
        (dense_layers + 1) * ((n + 63) >> 6) * sizeof(unsigned long long)
    )
    w.path_node = <int*>malloc((n_nodes + 1) * sizeof(int))
    w.path_edge = <long long*>malloc((n_nodes + 1) * sizeof(long long))
    w.path_forward = <char*>malloc((n_nodes + 1) * sizeof(char))
    w.path_value = <double*>malloc((n_nodes + 1) * sizeof(double))
    w.path_cap = <double*>malloc((n_nodes + 1) * sizeof(double))
    w.path_min = <double*>malloc((n_nodes + 2) * sizeof(double))
    w.queue = <int*>malloc(n_nodes * sizeof(int))
    w.left = <int*>malloc((n_layers + 1) * sizeof(int))
    w.deliverable = <double*>malloc(2 * n * sizeof(double))
    w.log_cap = 1024
    w.log_len = 0
    w.log = <long long*>malloc(w.log_cap * sizeof(long long))
    w.log_old = <double*>malloc(w.log_cap * sizeof(double))
    try:
        if (
            w.level == NULL or w.cur == NULL or w.bucket == NULL or w.alive == NULL
            or w.path_node == NULL or w.path_edge == NULL or w.path_forward == NULL
            or w.path_value == NULL or w.path_min == NULL or w.path_cap == NULL
            or w.log_old == NULL
            or w.queue == NULL or w.left == NULL or w.deliverable == NULL or w.log == NULL
        ):
            raise MemoryError()
        with nogil:
            # Sinks outside, rows inside: the bottom-up bound belongs to the sink.
            for si in range(n_sinks):
                m = <int>sinks[si]
                w.m = m
                refined = False
                memcpy(w.res + middle + n, w.sink_cols + <long long>m * n, n * sizeof(double))
                for ri in range(n_rows):
                    target = upper[ri, si]
                    if target <= 0.0:
                        continue
                    s = <int>rows[ri]
                    w.src_order = &src_order[ri, 0]
                    w.src_count = src_count[ri]
                    for k in range(n):
                        w.res[middle + k] = w.cap[(n_layers - 1) * nn + <long long>s * n + k]
                    total = 0.0
                    _layer_by_depth(&w)
                    if _blocking_flow(&w, False, target - tolerance, &total) < 0:
                        failed = 1
                        break
                    if total < target - tolerance:
                        if not refined:
                            _bottom_up(&w, m)
                            refined = True
                        bound = 0.0
                        for k in range(n):
                            c = w.cap[(n_layers - 1) * nn + <long long>s * n + k]
                            bound += w.deliverable[k] if w.deliverable[k] < c else c
                        if bound < target:
                            target = bound
                    if total < target - tolerance and not with_backward:
                        # Later phases need the backward arcs: the caller solves this
                        # pair again with them.
                        status[ri, si] = 3
                    while (
                        status[ri, si] != 3 and total < target - tolerance
                        and _layer_residual_graph(&w)
                    ):
                        if _blocking_flow(&w, True, target - tolerance, &total) < 0:
                            failed = 1
                            break
                    if failed:
                        break
                    if status[ri, si] == 3:
                        pass
                    elif total >= target - tolerance:
                        values[ri, si] = target
                        status[ri, si] = 1
                    else:
                        values[ri, si] = total
                        status[ri, si] = 2
                    _reset(&w)
                    memcpy(w.res + middle + n, w.sink_cols + <long long>m * n, n * sizeof(double))
                if failed:
                    break
        if failed:
            raise MemoryError()
    finally:
        free(w.level)
        free(w.cur)
        free(w.bucket)
        free(w.alive)
        free(w.path_node)
        free(w.path_edge)
        free(w.path_forward)
        free(w.path_value)
        free(w.path_cap)
        free(w.path_min)
        free(w.queue)
        free(w.left)
        free(w.deliverable)
        free(w.log)
        free(w.log_old)


# --------------------------------------------------------------------------- push-relabel
#
# Pairs that no first blocking flow certifies (strongly local attention: the tree bounds are
# loose, and Dinic needs about 7 phases, each a breadth-first search over most of the graph)
# are solved by push-relabel on small graphs: the residuals dense, each middle matrix twice
# (row-major, and transposed for the arcs back up), active nodes first in, first out (one
# discharge step each: its pushes until its excess is gone, or one relabel; on the banded
# ViT-size row 1.16x faster than highest label first), with the gap heuristic and a global
# relabelling (a breadth-first search back from the sink) after every `GLOBAL_EVERY` node
# count of relabels; a relabel stops at the first residual neighbour one label up (labels
# keep their layer's parity). Only the first phase is run: the flow into the sink when no
# node that can still reach it holds excess is the max-flow (the excess left on the
# source's side of the minimum cut is never sent back).


cdef enum:
    GLOBAL_EVERY = 6  # relabels between global relabellings, in node counts (the default)

cdef double FIRST_SHARE = 0.5  # of each arc out of the source, filled first (`_pr_max_flow`)


cdef struct Preflow:
    int n_layers            # T
    int n
    int source              # node ids as in `Work`: token j of layer a is (a-1) n + j
    int sink
    int cut_off             # the label of a node that cannot reach the sink: the node count
    long long global_every  # relabels between global relabellings
    const double* cap       # Ã_2 .. Ã_{T-1}, (T-2, n, n): matrix a - 2 holds Ã_a
    const double* cap_t     # the same, each matrix transposed
    double* res             # the forward residuals of their arcs, (T-2, n, n)
    double* res_t           # the same residuals, each matrix transposed
    double* into_sink       # (n,): residual of token j of layer 1 into the sink
    double* excess          # (nodes,)
    int* label
    int* cur                # current arc: 0 .. n-1 forward (0 alone at layer 1), n .. 2n-1 back
    int* active             # (nodes,): the active nodes, a circular queue
    int first               # where the queue starts
    int waiting             # and how many it holds
    char* queued            # (nodes,): 1 for the nodes in it
    int* count              # (cut_off + 1,): nodes with each label below cut_off
    int* queue              # the breadth-first search's
    int* left               # (T + 1,): tokens of each layer without a distance yet
    long long pushes
    long long relabels
    long long global_relabels
    long long arc_reads


cdef inline void _pr_activate(Preflow* p, int v) noexcept nogil:
    """Queue token node `v`, which holds excess (unless it is queued or cut off)."""
    if p.label[v] >= p.cut_off or p.queued[v]:
        return
    p.queued[v] = 1
    p.active[(p.first + p.waiting) % p.cut_off] = v
    p.waiting += 1


cdef inline void _pr_clear_queue(Preflow* p) noexcept nogil:
    cdef int v
    p.first = 0
    p.waiting = 0
    for v in range(p.cut_off):
        p.queued[v] = 0


cdef void _pr_global_relabel(Preflow* p) noexcept nogil:
    """Exact distances to the sink in the residual graph (a breadth-first search back).

    Nodes that cannot reach the sink get `cut_off`. As in `_layer_residual_graph`, the arcs
    into a layer are no longer read once every token of that layer has its distance.
    """
    cdef int n = p.n, n_layers = p.n_layers, cut = p.cut_off
    cdef int head = 0, tail = 0, v, u, a, k, i, d
    cdef long long nn = <long long>n * n
    cdef int* left = p.left
    cdef const double* row
    cdef const double* cap
    p.global_relabels += 1
    for v in range(cut):
        p.label[v] = cut
    for d in range(cut + 1):
        p.count[d] = 0
    for a in range(n_layers + 1):
        left[a] = n
    p.label[p.sink] = 0
    for k in range(n):
        if p.into_sink[k] > 0.0:
            p.label[k] = 1
            p.queue[tail] = k
            tail += 1
            left[1] -= 1
    while head < tail:
        v = p.queue[head]
        head += 1
        d = p.label[v] + 1
        a = v // n + 1
        k = v - (a - 1) * n
        if a <= n_layers - 2 and left[a + 1] > 0:
            # Token i of layer a + 1 has a residual arc into k: Ã_{a+1}[i, k] not full.
            row = p.res_t + (a - 1) * nn + <long long>k * n
            for i in range(n):
                u = a * n + i
                if p.label[u] == cut and row[i] > 0.0:
                    p.label[u] = d
                    p.queue[tail] = u
                    tail += 1
                    left[a + 1] -= 1
                    if left[a + 1] == 0:
                        break
            p.arc_reads += i + 1
        if a >= 2 and left[a - 1] > 0:
            # Token i of layer a - 1 has a residual arc back up into k: Ã_a[k, i] carries flow.
            row = p.res + (a - 2) * nn + <long long>k * n
            cap = p.cap + (a - 2) * nn + <long long>k * n
            for i in range(n):
                u = (a - 2) * n + i
                if p.label[u] == cut and cap[i] - row[i] > 0.0:
                    p.label[u] = d
                    p.queue[tail] = u
                    tail += 1
                    left[a - 1] -= 1
                    if left[a - 1] == 0:
                        break
            p.arc_reads += i + 1
    _pr_clear_queue(p)
    for v in range(p.source):
        p.cur[v] = 0
        d = p.label[v]
        if d < cut:
            p.count[d] += 1
            if p.excess[v] > 0.0:
                _pr_activate(p, v)


cdef void _pr_layer_labels(Preflow* p) noexcept nogil:
    """The first labels: each token's layer, its distance to the sink along arcs down.

    Valid before any push (every arc goes one layer down, and ``a <= (a - 1) + 1``); a
    token that cannot reach the sink is lifted by its relabels or the gap heuristic.
    """
    cdef int n = p.n, cut = p.cut_off, v, d
    for d in range(cut + 1):
        p.count[d] = 0
    p.label[p.sink] = 0
    _pr_clear_queue(p)
    for v in range(p.source):
        d = v // n + 1
        p.label[v] = d
        p.count[d] += 1
        p.cur[v] = 0
        if p.excess[v] > 0.0:
            _pr_activate(p, v)


cdef void _pr_relabel(Preflow* p, int u, int a, int j) noexcept nogil:
    """Lift token node `u` (token `j` of layer `a`) above its lowest residual neighbour.

    Labels below `cut_off` keep the parity of their layer (every arc joins neighbouring
    layers, the sink counting as layer 0, and the first labels are the layers), and no
    residual neighbour lies below the label of `u` (none is admissible): a neighbour at
    ``label + 1`` is the lowest there can be, and the scan stops at the first one. Where
    `u` was the last node of its label, every node above that label (below `cut_off`) can
    no longer reach the sink: all go to `cut_off` (the gap heuristic).
    """
    cdef int n = p.n, cut = p.cut_off, best = cut, old = p.label[u], i, v, d
    cdef int lowest = old + 1
    cdef long long nn = <long long>n * n
    cdef const double* row
    cdef const double* cap
    cdef const int* label
    p.relabels += 1
    if a == 1:
        if p.into_sink[j] > 0.0:
            best = 0
    else:
        row = p.res + (a - 2) * nn + <long long>j * n
        label = p.label + (a - 2) * n
        for i in range(n):
            d = label[i]
            if d < best and row[i] > 0.0:
                best = d
                if d <= lowest:
                    break
        p.arc_reads += i + 1
    if a <= p.n_layers - 2 and best > lowest:
        row = p.res_t + (a - 1) * nn + <long long>j * n
        cap = p.cap_t + (a - 1) * nn + <long long>j * n
        label = p.label + a * n
        for i in range(n):
            d = label[i]
            if d < best and cap[i] - row[i] > 0.0:
                best = d
                if d <= lowest:
                    break
        p.arc_reads += i + 1
    p.count[old] -= 1
    if p.count[old] == 0:
        for v in range(p.source):
            if old < p.label[v] < cut:
                p.count[p.label[v]] -= 1
                p.label[v] = cut
        p.label[u] = cut
        return
    if best + 1 >= cut:
        p.label[u] = cut
        return
    p.label[u] = best + 1
    p.count[best + 1] += 1
    p.cur[u] = 0


cdef bint _pr_discharge(Preflow* p, int u, double stop) noexcept nogil:
    """Push the excess of token node `u` along admissible arcs, or relabel it once.

    Returns True once the flow into the sink reaches `stop`. A push fills its arc (its
    residual set to exactly 0, or back to the capacity for an arc back up) or empties the
    excess of `u` (set to exactly 0).
    """
    cdef int n = p.n, a = u // n + 1, j = u - (a - 1) * n, i, v, want
    cdef long long nn = <long long>n * n, q
    cdef double e = p.excess[u], r
    cdef double* row
    cdef double* row_t
    cdef const double* cap
    want = p.label[u] - 1
    i = p.cur[u]
    if a == 1:
        if i == 0:
            p.arc_reads += 1
            r = p.into_sink[j]
            if want == 0 and r > 0.0:
                p.pushes += 1
                if e >= r:
                    p.into_sink[j] = 0.0
                    p.excess[p.sink] += r
                    e -= r
                else:
                    p.into_sink[j] = r - e
                    p.excess[p.sink] += e
                    e = 0.0
                p.excess[u] = e
                if p.excess[p.sink] >= stop:
                    return True
                if e <= 0.0:
                    p.excess[u] = 0.0
                    return False
            i = n
    else:
        # Arcs down, Ã_a[j, k] for every k: a row of each residual copy.
        row = p.res + (a - 2) * nn + <long long>j * n
        row_t = p.res_t + (a - 2) * nn + j
        while i < n:
            p.arc_reads += 1
            r = row[i]
            if r > 0.0 and p.label[(a - 2) * n + i] == want:
                v = (a - 2) * n + i
                p.pushes += 1
                if p.excess[v] == 0.0:
                    _pr_activate(p, v)
                q = <long long>i * n
                if e >= r:
                    row[i] = 0.0
                    row_t[q] = 0.0
                    p.excess[v] += r
                    e -= r
                    if e <= 0.0:
                        p.excess[u] = 0.0
                        p.cur[u] = i + 1
                        return False
                else:
                    row[i] = r - e
                    row_t[q] = r - e
                    p.excess[v] += e
                    p.excess[u] = 0.0
                    p.cur[u] = i
                    return False
            i += 1
    if a <= p.n_layers - 2:
        # Arcs back up, against the flow of Ã_{a+1}[k, j]: a row of the transposed copies.
        row_t = p.res_t + (a - 1) * nn + <long long>j * n
        cap = p.cap_t + (a - 1) * nn + <long long>j * n
        row = p.res + (a - 1) * nn + j
        while i < 2 * n:
            p.arc_reads += 1
            v = a * n + i - n
            if p.label[v] == want:
                r = cap[i - n] - row_t[i - n]
                if r > 0.0:
                    p.pushes += 1
                    if p.excess[v] == 0.0:
                        _pr_activate(p, v)
                    q = <long long>(i - n) * n
                    if e >= r:
                        row_t[i - n] = cap[i - n]
                        row[q] = cap[i - n]
                        p.excess[v] += r
                        e -= r
                        if e <= 0.0:
                            p.excess[u] = 0.0
                            p.cur[u] = i + 1
                            return False
                    else:
                        row_t[i - n] = row_t[i - n] + e
                        row[q] = row_t[i - n]
                        p.excess[v] += e
                        p.excess[u] = 0.0
                        p.cur[u] = i
                        return False
            i += 1
    p.excess[u] = e
    _pr_relabel(p, u, a, j)
    return False


cdef double _pr_max_flow(
    Preflow* p, const double* source_row, const double* sink_column, double stop, double* given
) noexcept nogil:
    """The max-flow from the source (arcs `source_row`) to the sink (arcs `sink_column`).

    Or, once the flow into the sink reaches `stop`, that flow. Expects every residual at
    its capacity; leaves them as the solve left them. The source's arcs are filled in two
    rounds: `FIRST_SHARE` of each, then, once no node that can reach the sink holds excess,
    the rest of those into tokens that can still reach it (a token that cannot, cut off by
    the gap heuristic or a global relabelling, would only hold it). Filling an arc out of
    the source leaves it without residual, so the labels stay valid; the flow into the sink
    is the max-flow once every arc out of the source is full or leads to a token cut off.
    On the banded ViT-size row, less excess is lifted to the cut-off label: highest label
    first, 0.62 against 0.78 CPU s for the whole row (relabels 0.90 against 1.04 million);
    first in, first out, 0.67 to 0.71 against 0.73 s.
    """
    cdef int n = p.n, u, cut = p.cut_off, k, top = (p.n_layers - 2) * p.n, rounds
    cdef long long since = p.relabels  # the pair's own count: its way is its own
    cdef double more
    for u in range(cut):
        p.excess[u] = 0.0
    for u in range(n):
        p.into_sink[u] = sink_column[u]
        given[u] = 0.0
    _pr_layer_labels(p)
    for rounds in range(2):
        for k in range(n):
            if p.label[top + k] >= cut or given[k] >= source_row[k]:
                continue
            more = source_row[k] * FIRST_SHARE if rounds == 0 else source_row[k]
            if more > given[k]:
                if p.excess[top + k] == 0.0:
                    _pr_activate(p, top + k)
                p.excess[top + k] += more - given[k]
                given[k] = more
        while p.waiting > 0:
            u = p.active[p.first]
            p.first = (p.first + 1) % cut
            p.waiting -= 1
            p.queued[u] = 0
            if p.label[u] >= cut or p.excess[u] <= 0.0:
                continue  # cut off by the gap heuristic since, or emptied
            if _pr_discharge(p, u, stop):
                return p.excess[p.sink]
            if p.excess[u] > 0.0:
                _pr_activate(p, u)
            if p.relabels - since >= p.global_every:
                since = p.relabels
                _pr_global_relabel(p)
    return p.excess[p.sink]


def solve_push_relabel(
    const double[:, :, ::1] mixed,
    const double[:, :, ::1] middle_t,
    const double[:, ::1] sink_columns,
    const long long[::1] rows,
    const long long[::1] sinks,
    const double[:, ::1] upper,
    const long long[:, ::1] fwd_start,
    const unsigned short[::1] arc_head,
    const int[:, :, ::1] bucket_end,
    const unsigned char[::1] sorted_heads,
    const int[:, ::1] reach_lo,
    const int[:, ::1] reach_hi,
    double tolerance,
    double[:, ::1] values,
    signed char[:, ::1] status,
    long long self_base=-1,
    const double[::1] arc_cap=None,
    long long[::1] counters=None,
    int global_every=GLOBAL_EVERY,
):
    """Max-flows from each of `rows` to each of `sinks` by push-relabel (dense residuals).

    `middle_t` holds ``Ã_2 .. Ã_{T-1}`` each transposed (C-contiguous). The values and
    statuses are those of `solve` with backward arcs, to rounding: a pair whose max-flow
    comes within `tolerance` of its bound `upper` reports the bound (status 1), tightened
    first, where the max-flow misses it, by the sink's bottom-up tree bound (`_bottom_up`
    on the arcs as `solve` takes them, so the same bound to the bit); otherwise its
    max-flow (status 2). Pairs with a zero bound are left alone. `counters` (4,), if given,
    receives the pushes, relabels, global relabellings and arc reads, added. A global
    relabelling follows every `global_every` node counts of relabels (0: every step).
    """
    cdef int n_layers = mixed.shape[0], n = mixed.shape[2]
    cdef Py_ssize_t n_rows = rows.shape[0], n_sinks = sinks.shape[0], ri, si
    cdef long long nn = <long long>n * n, middle = (n_layers - 2) * nn
    cdef long long n_arcs = arc_head.shape[0]
    cdef int s, m, cut, k
    cdef double target, flow, bound, c
    cdef bint refined
    cdef Preflow p
    cdef Work w  # what `_bottom_up` reads
    cdef double* column = NULL
    cdef double* given = NULL
    if n_layers < 3:
        raise ValueError("the kernel solves graphs of three or more layers")
    if (
        middle_t.shape[0] != n_layers - 2 or middle_t.shape[1] != n or middle_t.shape[2] != n
        or sink_columns.shape[0] != n or sink_columns.shape[1] != n
        or upper.shape[0] != n_rows or upper.shape[1] != n_sinks
        or values.shape[0] != n_rows or values.shape[1] != n_sinks
        or status.shape[0] != n_rows or status.shape[1] != n_sinks
    ):
        raise ValueError(
            "`middle_t` must be (T-2, n, n), `sink_columns` (n, n), and `upper`, `values`, "
            "`status` (rows, sinks)"
        )
    if arc_cap is not None and arc_cap.shape[0] != n_arcs:
        raise ValueError("`arc_cap` must have one capacity per arc")
    if counters is not None and counters.shape[0] != 4:
        raise ValueError("`counters` must have 4 entries")
    if global_every < 0:
        raise ValueError(f"`global_every` must be 0 or more, not {global_every}")
    w.n_layers = n_layers
    w.n = n
    w.cap = &mixed[0, 0, 0]
    w.sink_cols = &sink_columns[0, 0]
    w.fwd_start = &fwd_start[0, 0]
    w.arc_head = &arc_head[0] if n_arcs > 0 else NULL
    w.bucket_end = &bucket_end[0, 0, 0]
    w.sorted_heads = &sorted_heads[0]
    w.reach_lo = &reach_lo[0, 0]
    w.reach_hi = &reach_hi[0, 0]
    w.self_on = self_base >= 0
    w.self_base = self_base
    w.arc_cap = &arc_cap[0] if arc_cap is not None and n_arcs > 0 else NULL
    w.deliverable = NULL
    cut = (n_layers - 1) * n + 2
    p.n_layers = n_layers
    p.n = n
    p.source = (n_layers - 1) * n
    p.sink = p.source + 1
    p.cut_off = cut
    p.global_every = <long long>global_every * cut
    p.cap = &mixed[1, 0, 0]
    p.cap_t = &middle_t[0, 0, 0]
    p.pushes = p.relabels = p.global_relabels = p.arc_reads = 0
    p.res = <double*>malloc(middle * sizeof(double))
    p.res_t = <double*>malloc(middle * sizeof(double))
    p.into_sink = <double*>malloc(n * sizeof(double))
    p.excess = <double*>malloc(cut * sizeof(double))
    p.label = <int*>malloc(cut * sizeof(int))
    p.cur = <int*>malloc(cut * sizeof(int))
    p.left = <int*>malloc((n_layers + 1) * sizeof(int))
    p.active = <int*>malloc(cut * sizeof(int))
    p.queued = <char*>malloc(cut * sizeof(char))
    p.count = <int*>malloc((cut + 1) * sizeof(int))
    p.queue = <int*>malloc(cut * sizeof(int))
    w.deliverable = <double*>malloc(2 * n * sizeof(double))
    given = <double*>malloc(n * sizeof(double))
    try:
        if (
            p.res == NULL or p.res_t == NULL or p.into_sink == NULL or p.excess == NULL
            or p.label == NULL or p.cur == NULL or p.left == NULL or p.active == NULL
            or p.queued == NULL or p.count == NULL or p.queue == NULL
            or w.deliverable == NULL or given == NULL
        ):
            raise MemoryError()
        with nogil:
            for si in range(n_sinks):
                m = <int>sinks[si]
                w.m = m
                column = w.sink_cols + <long long>m * n
                refined = False
                for ri in range(n_rows):
                    target = upper[ri, si]
                    if target <= 0.0:
                        continue
                    s = <int>rows[ri]
                    memcpy(p.res, p.cap, middle * sizeof(double))
                    memcpy(p.res_t, p.cap_t, middle * sizeof(double))
                    flow = _pr_max_flow(
                        &p, &mixed[n_layers - 1, s, 0], column, target - tolerance, given
                    )
                    if flow < target - tolerance:
                        # As `solve`: the bottom-up bound of the sink, summed the same way.
                        if not refined:
                            _bottom_up(&w, m)
                            refined = True
                        bound = 0.0
                        for k in range(n):
                            c = mixed[n_layers - 1, s, k]
                            bound += w.deliverable[k] if w.deliverable[k] < c else c
                        if bound < target:
                            target = bound
                    if flow >= target - tolerance:
                        values[ri, si] = target
                        status[ri, si] = 1
                    else:
                        values[ri, si] = flow
                        status[ri, si] = 2
    finally:
        free(p.res)
        free(p.res_t)
        free(p.into_sink)
        free(p.excess)
        free(p.label)
        free(p.cur)
        free(p.left)
        free(p.active)
        free(p.queued)
        free(p.count)
        free(p.queue)
        free(w.deliverable)
        free(given)
    if counters is not None:
        counters[0] += p.pushes
        counters[1] += p.relabels
        counters[2] += p.global_relabels
        counters[3] += p.arc_reads
