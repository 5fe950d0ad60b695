/* A free loopback port (see free_port.h). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tools/common/free_port.h"

/* 1 when nothing is bound to 127.0.0.1:port now */
static int port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

/* Ports below the kernel's ephemeral range: no outgoing connection is ever given one as its
 * local port, so a rank connecting before rank 0 listens cannot connect to itself on it. */
int kt_tool_free_port(void)
{
    int lo = 32768, hi = 60999;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f != NULL) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2)
            lo = 32768;
        fclose(f);
    }
    const int first = 10000, span = lo - first;
    if (span > 100) {
        unsigned s = (unsigned)time(NULL) ^ ((unsigned)getpid() << 16);
        for (int tries = 0; tries < 200; tries++) {
            s = s * 1103515245u + 12345u;
            const int port = first + (int)((s >> 8) % (unsigned)span);
            if (port_free(port))
                return port;
        }
    }
    /* no room below the range: any port the kernel picks */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}
