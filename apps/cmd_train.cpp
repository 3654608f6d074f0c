#include "commands.h"
#include "core/error.h"
namespace origami {
int cmd_train(int, char**) { fail("'train' is being built"); }  // TEMPORARY scaffold, replaced before landing
}
