/* Shared by the tools that start local ranks (kt-launch, kt-bench comm/halo). */
#ifndef KT_TOOLS_FREE_PORT_H
#define KT_TOOLS_FREE_PORT_H

/* A loopback TCP port nobody listens on right now, below the ephemeral range where there is
 * room (rank 0 binds it again moments later);
 * -1 when none could be had. */
int kt_tool_free_port(void);

#endif
