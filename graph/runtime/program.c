/* Programs: validation, queries and the printed plan (the runtime half: no compiler code). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "graph/plan.h"
#include "graph/program_internal.h"
#include "ops/op_desc.h"

void kt__scratch_meta(kt_tensor *meta, uint64_t bytes)
{
    int64_t words = (int64_t)((bytes + 3) / 4);
    (void)kt_tensor_init(meta, NULL, KT_I32, 1, &words);
}

void kt__program_free(kt_program *p)
{
    if (p == NULL)
        return;
    free(p->bufs);
    free(p->steps);
    for (int r = 0; r < 3; r++)
        free(p->entries[r]);
    kt__strings_free(&p->strings);
    free(p);
}

void kt_program_destroy(kt_program *p) { kt__program_free(p); }

/* ---- validation ----------------------------------------------------------------------------- */

static int name_ok(const kt_program *p, int32_t name)
{
    return name == -1 || (name >= 0 && (size_t)name < p->strings.len);
}

static kt_status check_buf(const kt_program *p, int32_t i)
{
    const kt__pbuf *b = &p->bufs[i];
    const kt_tensor *m = &b->meta;
    if (b->region < 0 || b->region >= KT__REGION_COUNT)
        return kt__error(KT_EFORMAT, "buffer %d: invalid region %d", i, b->region);
    if ((unsigned)m->dtype >= KT_DTYPE_COUNT || m->ndim < 0 || m->ndim > KT_MAX_DIMS)
        return kt__error(KT_EFORMAT, "buffer %d: invalid dtype or rank", i);
    uint64_t numel = 1;
    for (int d = 0; d < m->ndim; d++) {
        if (m->shape[d] < 0 || (m->shape[d] > 0 && numel > (UINT64_MAX >> 4) / (uint64_t)m->shape[d]))
            return kt__error(KT_EFORMAT, "buffer %d: invalid shape", i);
        numel *= (uint64_t)m->shape[d];
    }
    if (b->bytes < numel * kt_dtype_size(m->dtype))
        return kt__error(KT_EFORMAT, "buffer %d: %llu bytes cannot hold its tensor", i,
                         (unsigned long long)b->bytes);
    uint64_t region = p->region_bytes[b->region];
    if (b->offset % KT__PLAN_ALIGN != 0 || b->offset > region || b->bytes > region - b->offset)
        return kt__error(KT_EFORMAT, "buffer %d: offset %llu + %llu bytes outside its %llu-byte "
                         "region", i, (unsigned long long)b->offset,
                         (unsigned long long)b->bytes, (unsigned long long)region);
    if (b->region == KT__REGION_ACT) {
        if (b->first < 0 || b->first > b->last || b->last >= (p->n_steps > 0 ? p->n_steps : 1))
            return kt__error(KT_EFORMAT, "buffer %d: invalid lifetime [%d, %d]", i, b->first,
                             b->last);
        if (b->storage < 0 || b->storage >= p->n_bufs)
            return kt__error(KT_EFORMAT, "buffer %d: invalid storage %d", i, b->storage);
        const kt__pbuf *root = &p->bufs[b->storage];
        if (root->region != KT__REGION_ACT || root->storage != b->storage ||
            root->offset != b->offset || root->bytes != b->bytes)
            return kt__error(KT_EFORMAT, "buffer %d: inconsistent in-place sharing", i);
    }
    return KT_OK;
}

static kt_status check_id(const kt_program *p, int32_t at, const char *what, int32_t id,
                          int optional)
{
    if ((optional && id == -1) || (id >= 0 && id < p->n_bufs))
        return KT_OK;
    return kt__error(KT_EFORMAT, "step %d: %s buffer %d does not exist", at, what, id);
}

/* A step's use of an activation buffer must fall inside the buffer's lifetime. */
static kt_status check_live(const kt_program *p, int32_t at, int32_t id)
{
    if (id < 0)
        return KT_OK;
    const kt__pbuf *b = &p->bufs[id];
    if (b->region == KT__REGION_ACT && (at < b->first || at > b->last))
        return kt__error(KT_EFORMAT, "step %d uses buffer %d outside its lifetime [%d, %d]", at,
                         id, b->first, b->last);
    return KT_OK;
}

static int same_meta(const kt_tensor *a, const kt_tensor *b)
{
    return a->dtype == b->dtype && kt_tensor_same_shape(a, b);
}

static kt_status check_op_step(const kt_program *p, int32_t at, const kt__pstep *s)
{
    const kt__op_desc *d = kt__op_get(s->op);
    if (d == NULL)
        return kt__error(KT_EFORMAT, "step %d: invalid op %d", at, (int)s->op);
    if (s->n_in < d->min_in || s->n_in > d->max_in || s->n_out != d->n_out)
        return kt__error(KT_EFORMAT, "step %d (%s): wrong input or output count", at, d->name);
    kt_tensor in[KT_OP_MAX_IN], out[KT_OP_MAX_OUT];
    for (int32_t i = 0; i < s->n_in; i++) {
        KT__TRY(check_id(p, at, "input", s->in[i], 0));
        in[i] = p->bufs[s->in[i]].meta;
    }
    for (int32_t o = 0; o < s->n_out; o++)
        KT__TRY(check_id(p, at, "output", s->out[o], 0));
    if (kt_op_infer(s->op, &s->attrs, in, s->n_in, out, s->n_out) != KT_OK)
        return kt__error_context(KT_EFORMAT, "step %d (%s)", at, d->name);
    for (int32_t o = 0; o < s->n_out; o++)
        if (!same_meta(&out[o], &p->bufs[s->out[o]].meta))
            return kt__error(KT_EFORMAT, "step %d (%s): output %d has the wrong shape", at,
                             d->name, o);
    size_t need = kt_op_scratch_bytes(s->op, &s->attrs, in, s->n_in,
                                      s->kind == KT__STEP_BACKWARD);
    KT__TRY(check_id(p, at, "scratch", s->scratch, 1));
    if (need > 0 && (s->scratch < 0 || p->bufs[s->scratch].bytes < need ||
                     p->bufs[s->scratch].region != KT__REGION_ACT))
        return kt__error(KT_EFORMAT, "step %d (%s): needs %zu bytes of scratch", at, d->name,
                         need);
    if (s->kind == KT__STEP_BACKWARD) {
        for (int32_t o = 0; o < s->n_out; o++) {
            KT__TRY(check_id(p, at, "output gradient", s->gout[o], 1));
            int integer = out[o].dtype == KT_I32 || out[o].dtype == KT_I64;
            if (integer ? s->gout[o] != -1
                        : s->gout[o] < 0 || !same_meta(&p->bufs[s->gout[o]].meta, &out[o]))
                return kt__error(KT_EFORMAT, "step %d (%s): bad gradient of output %d", at,
                                 d->name, o);
        }
        for (int32_t i = 0; i < s->n_in; i++) {
            KT__TRY(check_id(p, at, "input gradient", s->gin[i], 1));
            if (s->gin[i] >= 0 && ((d->no_grad_in & (1u << i)) ||
                                   !same_meta(&p->bufs[s->gin[i]].meta, &in[i])))
                return kt__error(KT_EFORMAT, "step %d (%s): bad gradient of input %d", at,
                                 d->name, i);
        }
    }
    return KT_OK;
}

static kt_status check_step(const kt_program *p, int32_t at)
{
    const kt__pstep *s = &p->steps[at];
    if (!name_ok(p, s->name))
        return kt__error(KT_EFORMAT, "step %d: invalid name", at);
    if ((s->flags & ~KT__STEP_RECOMPUTE) != 0 ||
        ((s->flags & KT__STEP_RECOMPUTE) && (s->kind != KT__STEP_FORWARD || at < p->n_forward)))
        return kt__error(KT_EFORMAT, "step %d: invalid flags 0x%x", at, (unsigned)s->flags);
    switch (s->kind) {
    case KT__STEP_FORWARD:
    case KT__STEP_BACKWARD:
        KT__TRY(check_op_step(p, at, s));
        break;
    case KT__STEP_FILL: /* fill and accumulate steps have no scratch (its id is unchecked) */
        if (s->n_out != 1 || s->n_in != 0 || s->scratch != -1)
            return kt__error(KT_EFORMAT, "step %d: bad fill step", at);
        KT__TRY(check_id(p, at, "output", s->out[0], 0));
        if (p->bufs[s->out[0]].region != KT__REGION_ACT)
            return kt__error(KT_EFORMAT, "step %d: fill outside the activation region", at);
        break;
    case KT__STEP_ACCUM_GRAD:
        if (s->n_out != 1 || s->n_in != 1 || s->scratch != -1)
            return kt__error(KT_EFORMAT, "step %d: bad accumulate step", at);
        KT__TRY(check_id(p, at, "input", s->in[0], 0));
        KT__TRY(check_id(p, at, "output", s->out[0], 0));
        if (p->bufs[s->out[0]].region != KT__REGION_GRAD ||
            p->bufs[s->in[0]].meta.dtype != KT_F32 ||
            !same_meta(&p->bufs[s->in[0]].meta, &p->bufs[s->out[0]].meta))
            return kt__error(KT_EFORMAT, "step %d: bad accumulate step", at);
        break;
    default:
        return kt__error(KT_EFORMAT, "step %d: invalid kind %d", at, s->kind);
    }
    /* every activation buffer the step touches is alive at that step (what it reads of
     * in/out in backward is a subset, but checking all is only stricter for reads) */
    const kt__op_desc *d = s->kind <= KT__STEP_BACKWARD ? kt__op_get(s->op) : NULL;
    for (int32_t i = 0; i < s->n_in; i++)
        if (s->kind != KT__STEP_BACKWARD || (d->bwd_reads_in & (1u << i)))
            KT__TRY(check_live(p, at, s->in[i]));
    for (int32_t o = 0; o < s->n_out; o++)
        if (s->kind != KT__STEP_BACKWARD || (d->bwd_reads_out & (1u << o)))
            KT__TRY(check_live(p, at, s->out[o]));
    if (s->kind == KT__STEP_BACKWARD) {
        for (int32_t o = 0; o < s->n_out; o++)
            KT__TRY(check_live(p, at, s->gout[o]));
        for (int32_t i = 0; i < s->n_in; i++)
            KT__TRY(check_live(p, at, s->gin[i]));
    }
    return check_live(p, at, s->scratch);
}

static kt_status check_entries(const kt_program *p)
{
    static const char *const role_names[3] = {"input", "parameter", "output"};
    for (int r = 0; r < 3; r++) {
        if (p->n_entries[r] < 0 || (p->n_entries[r] > 0 && p->entries[r] == NULL))
            return kt__error(KT_EFORMAT, "invalid %s table", role_names[r]);
        for (int32_t i = 0; i < p->n_entries[r]; i++) {
            const kt__pentry *e = &p->entries[r][i];
            if (e->name < 0 || !name_ok(p, e->name) || e->buf < 0 || e->buf >= p->n_bufs)
                return kt__error(KT_EFORMAT, "%s %d: invalid entry", role_names[r], i);
            int32_t region = p->bufs[e->buf].region;
            if ((r == KT_ROLE_INPUT && region != KT__REGION_ACT) ||
                (r == KT_ROLE_PARAM && region != KT__REGION_PARAM))
                return kt__error(KT_EFORMAT, "%s %d: buffer in the wrong region", role_names[r],
                                 i);
            if (e->grad_buf != -1 &&
                (r != KT_ROLE_PARAM || e->grad_buf < 0 || e->grad_buf >= p->n_bufs ||
                 p->bufs[e->grad_buf].region != KT__REGION_GRAD ||
                 p->bufs[e->grad_buf].meta.dtype != KT_F32 || /* the optimizer reads f32 */
                 !same_meta(&p->bufs[e->grad_buf].meta, &p->bufs[e->buf].meta)))
                return kt__error(KT_EFORMAT, "%s %d: invalid gradient buffer", role_names[r], i);
            if ((unsigned)e->init.kind > KT_INIT_LOADED)
                return kt__error(KT_EFORMAT, "%s %d: invalid initialiser", role_names[r], i);
            if (e->shard_dim != -1 &&
                (r != KT_ROLE_INPUT || e->shard_dim < 0 || e->shard_dim >= p->bufs[e->buf].meta.ndim))
                return kt__error(KT_EFORMAT, "%s %d: invalid shard dimension %d", role_names[r], i,
                                 e->shard_dim);
        }
    }
    return KT_OK;
}

static kt_status check_plan(const kt_program *p)
{
    kt__plan_item *items = calloc((size_t)p->n_bufs + 1, sizeof *items);
    uint64_t *offsets = calloc((size_t)p->n_bufs + 1, sizeof *offsets);
    kt_status status = KT_OK;
    if (items == NULL || offsets == NULL) {
        status = kt__error(KT_ENOMEM, "program check: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < p->n_bufs; i++) {
        const kt__pbuf *b = &p->bufs[i];
        if (b->region != KT__REGION_ACT)
            continue;
        kt__plan_item *it = &items[b->storage];
        if (it->bytes == 0) {
            it->first = b->first;
            it->last = b->last;
        }
        it->bytes = b->bytes;
        offsets[b->storage] = b->offset;
        if (b->first < it->first)
            it->first = b->first;
        if (b->last > it->last)
            it->last = b->last;
    }
    status = kt__plan_check(items, offsets, p->n_bufs, p->region_bytes[KT__REGION_ACT]);
    if (status != KT_OK)
        status = kt__error_context(KT_EFORMAT, "program");
out:
    free(items);
    free(offsets);
    return status;
}

kt_status kt__program_validate(const kt_program *p)
{
    if (p->n_bufs < 0 || p->n_steps < 0 || p->n_forward < 0 || p->n_forward > p->n_steps ||
        (p->n_bufs > 0 && p->bufs == NULL) || (p->n_steps > 0 && p->steps == NULL))
        return kt__error(KT_EFORMAT, "program: invalid table sizes");
    if (p->strings.len > 0 && p->strings.data[p->strings.len - 1] != '\0')
        return kt__error(KT_EFORMAT, "program: names are not terminated");
    for (int32_t i = 0; i < p->n_bufs; i++)
        KT__TRY(check_buf(p, i));
    for (int32_t at = 0; at < p->n_steps; at++)
        KT__TRY(check_step(p, at));
    KT__TRY(check_entries(p));
    if (p->loss_buf != -1 && (p->loss_buf < 0 || p->loss_buf >= p->n_bufs ||
                              p->bufs[p->loss_buf].meta.dtype != KT_F32 ||
                              kt_tensor_numel(&p->bufs[p->loss_buf].meta) != 1))
        return kt__error(KT_EFORMAT, "program: invalid loss buffer");
    return check_plan(p);
}

/* ---- queries ------------------------------------------------------------------------------------ */

void kt_program_get_stats(const kt_program *p, kt_program_stats *st)
{
    memset(st, 0, sizeof *st);
    st->n_forward_steps = p->n_forward;
    st->n_backward_steps = p->n_steps - p->n_forward;
    st->n_inputs = p->n_entries[KT_ROLE_INPUT];
    st->n_params = p->n_entries[KT_ROLE_PARAM];
    st->n_outputs = p->n_entries[KT_ROLE_OUTPUT];
    st->n_buffers = p->n_bufs;
    st->arena_bytes = p->region_bytes[KT__REGION_ACT];
    st->lower_bound_bytes = p->lower_bound;
    st->param_bytes = p->region_bytes[KT__REGION_PARAM];
    st->grad_bytes = p->region_bytes[KT__REGION_GRAD];
    for (int32_t i = 0; i < p->n_steps; i++) {
        if (p->steps[i].flags & KT__STEP_RECOMPUTE) {
            st->recompute_flops += p->steps[i].flops;
            st->n_recompute_steps++;
        } else if (i < p->n_forward) {
            st->forward_flops += p->steps[i].flops;
        } else {
            st->backward_flops += p->steps[i].flops;
        }
    }
}

int kt_program_count(const kt_program *p, kt_tensor_role role)
{
    if (p == NULL)
        return 0;
    if (role == KT_ROLE_GRAD) {
        int n = 0;
        for (int32_t i = 0; i < p->n_entries[KT_ROLE_PARAM]; i++)
            n += p->entries[KT_ROLE_PARAM][i].grad_buf >= 0;
        return n;
    }
    return (unsigned)role < 3 ? p->n_entries[role] : 0;
}

kt_status kt_program_tensor_info(const kt_program *p, kt_tensor_role role, int i,
                                 const char **name_out, kt_tensor *meta_out)
{
    if (p == NULL)
        return kt__error(KT_EINVAL, "kt_program_tensor_info: program is NULL");
    int r = role == KT_ROLE_GRAD ? KT_ROLE_PARAM : (int)role;
    if ((unsigned)r >= 3)
        return kt__error(KT_EINVAL, "kt_program_tensor_info: invalid role %d", (int)role);
    const kt__pentry *e = NULL;
    if (role == KT_ROLE_GRAD) {
        for (int32_t k = 0, seen = 0; k < p->n_entries[r]; k++)
            if (p->entries[r][k].grad_buf >= 0 && seen++ == i)
                e = &p->entries[r][k];
    } else if (i >= 0 && i < p->n_entries[r]) {
        e = &p->entries[r][i];
    }
    if (e == NULL)
        return kt__error(KT_EINVAL, "kt_program_tensor_info: index %d out of range", i);
    if (name_out)
        *name_out = kt__strings_get(&p->strings, e->name);
    if (meta_out)
        *meta_out = p->bufs[role == KT_ROLE_GRAD ? e->grad_buf : e->buf].meta;
    return KT_OK;
}

kt_status kt_program_shard_dim(const kt_program *p, const char *input, int *dim_out)
{
    if (p == NULL || input == NULL || dim_out == NULL)
        return kt__error(KT_EINVAL, "kt_program_shard_dim: NULL argument");
    for (int32_t i = 0; i < p->n_entries[KT_ROLE_INPUT]; i++) {
        const kt__pentry *e = &p->entries[KT_ROLE_INPUT][i];
        if (strcmp(kt__strings_get(&p->strings, e->name), input) == 0) {
            *dim_out = e->shard_dim;
            return KT_OK;
        }
    }
    return kt__error(KT_EINVAL, "kt_program_shard_dim: no input named '%s'", input);
}
