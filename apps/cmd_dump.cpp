#include "commands.h"
#include "core/error.h"
namespace origami {
int cmd_dump(int, char**) { fail("'dump' is being built"); }  // TEMPORARY scaffold, replaced before landing
}
