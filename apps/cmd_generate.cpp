#include "commands.h"
#include "core/error.h"
namespace origami {
int cmd_generate(int, char**) { fail("'generate' is being built"); }  // TEMPORARY scaffold, replaced before landing
}
