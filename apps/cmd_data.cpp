#include "commands.h"
#include "core/error.h"
namespace origami {
int cmd_data(int, char**) { fail("'data' is being built"); }  // TEMPORARY scaffold, replaced before landing
}
