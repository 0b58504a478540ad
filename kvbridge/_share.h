/* kvbridge/_share.h: one native call's work shared by the calling thread and at most one helper
 * thread, for kvbridge's C extensions (scheduling/_digest.c, transports/shm/_rangecopy.c).
 *
 * The helper is detached and may start late (busy cores): the caller never waits for one that
 * has not started. Each side takes items from the job (the caller from the front, the helper
 * from the back, through one atomic counter of the extension's own); when nothing is left the
 * caller closes the share, and a helper that starts later leaves without touching the job's
 * items. The caller waits only while the helper is inside its work. The job starts with one
 * reference (the caller's), two once the helper started; whoever drops the last frees it.
 * Nothing here touches Python: all of it runs with or without the GIL.
 */
#ifndef KVBRIDGE_SHARE_H
#define KVBRIDGE_SHARE_H

#include <pthread.h>

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t idle;
    int refs, closed, active, finished;
} kvb_share;

static void kvb_share_init(kvb_share *s) {
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->idle, NULL);
    s->refs = 1;
    s->closed = s->active = s->finished = 0;
}

/* Start fn(arg) on a detached helper thread; 1 if it started (the share then has two refs). */
static int kvb_share_spawn(kvb_share *s, void *(*fn)(void *), void *arg) {
    pthread_attr_t attr;
    pthread_t th;
    if (pthread_attr_init(&attr) != 0) return 0;
    s->refs = 2;  /* before the helper runs: it may drop its reference at once */
    if (pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) != 0
        || pthread_create(&th, &attr, fn, arg) != 0) {
        s->refs = 1;
    }
    pthread_attr_destroy(&attr);
    return s->refs == 2;
}

/* The helper, first: 1 if it may work (the caller has not closed the share). */
static int kvb_share_enter(kvb_share *s) {
    pthread_mutex_lock(&s->mu);
    int go = !s->closed;
    s->active = go;
    pthread_mutex_unlock(&s->mu);
    return go;
}

/* The helper, after its work (only when kvb_share_enter said 1). */
static void kvb_share_leave(kvb_share *s) {
    pthread_mutex_lock(&s->mu);
    s->active = 0;
    s->finished = 1;
    pthread_cond_signal(&s->idle);
    pthread_mutex_unlock(&s->mu);
}

/* The caller, for tests of the helper's path: wait until the helper did its work. */
static void kvb_share_wait_finished(kvb_share *s) {
    pthread_mutex_lock(&s->mu);
    while (!s->finished) pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* The caller, once nothing is left to take: close the share and wait while the helper works. */
static void kvb_share_close(kvb_share *s) {
    pthread_mutex_lock(&s->mu);
    s->closed = 1;
    while (s->active) pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Drop one reference; 1 if it was the last (the share is destroyed: free the job holding it). */
static int kvb_share_drop(kvb_share *s) {
    pthread_mutex_lock(&s->mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (last) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->idle);
    }
    return last;
}

#endif
