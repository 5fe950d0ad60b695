/* Status codes and the last-error message.
 *
 * Every fallible libkt function returns a kt_status. On failure the library records a
 * message with context (which op, which tensor, which argument) in a thread-local buffer,
 * readable through kt_last_error() until the next failure on the same thread. The library
 * never prints, aborts or exits.
 */
#ifndef KT_STATUS_H
#define KT_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/* One list generates the enum and the names (kt_status_str). Codes are 0 or negative. */
#define KT_STATUS_LIST(X)                                                          \
    X(OK, 0, "success")                                                            \
    X(EINVAL, -1, "invalid argument")                                              \
    X(ENOMEM, -2, "out of memory")                                                 \
    X(ERANGE, -3, "value out of range")                                            \
    X(EIO, -4, "input/output error")                                               \
    X(EFORMAT, -5, "malformed or corrupt data")                                    \
    X(EUNSUPPORTED, -6, "not supported by this build or machine")                  \
    X(ETIMEDOUT, -7, "timed out")                                                  \
    X(EPEER, -8, "peer failed")                                                    \
    X(ESTATE, -9, "object is in a failed or wrong state")                          \
    X(EINTERNAL, -10, "internal error")

typedef enum kt_status {
#define KT__STATUS_ENUM(name, value, text) KT_##name = value,
    KT_STATUS_LIST(KT__STATUS_ENUM)
#undef KT__STATUS_ENUM
} kt_status;

/* Short description of a status code ("invalid argument"); never NULL. */
const char *kt_status_str(kt_status status);

/* The message of the last failure on this thread, with context; "" if none. */
const char *kt_last_error(void);

/* Forget the last failure on this thread. */
void kt_clear_error(void);

/* Records the application's own failure as this thread's last error (printf-style) and
 * returns status: so that kt_comm_agree, which carries kt_last_error() to the other ranks,
 * carries the application's reason too. */
kt_status kt_set_error(kt_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif
