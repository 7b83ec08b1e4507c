/* Confine wildcard listeners to loopback: loaded with LD_PRELOAD into the server
 * processes of a topology whose host is a loopback address (pdctl/launch/loopback.py).
 *
 * Some libraries a server loads bind their listeners to every interface and offer no
 * option to do otherwise (Mooncake's TCP transport and handshake server). This bind()
 * rewrites a wildcard address to loopback and leaves every other address alone:
 *   0.0.0.0                  -> 127.0.0.1
 *   ::  (IPV6_V6ONLY set)    -> ::1
 *   ::  (dual-stack)         -> ::ffff:127.0.0.1 (IPv4 loopback peers still connect)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind(void) {
    static bind_fn found;
    if (!found) found = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return found;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn next = real_bind();
    if (!next) {
        errno = ENOSYS;
        return -1;
    }
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return next(fd, (const struct sockaddr *)&in4, sizeof in4);
        }
    } else if (addr && addr->sa_family == AF_INET6 &&
               len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
            int v6only = 0;
            socklen_t size = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &size) != 0) v6only = 0;
            if (v6only) {
                in6.sin6_addr = in6addr_loopback;
            } else {
                memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
                in6.sin6_addr.s6_addr[10] = 0xff;
                in6.sin6_addr.s6_addr[11] = 0xff;
                in6.sin6_addr.s6_addr[12] = 127;
                in6.sin6_addr.s6_addr[15] = 1;
            }
            return next(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return next(fd, addr, len);
}
