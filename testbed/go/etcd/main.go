// Command etcd is upstream etcd's server main, wrapped in a module of our own
// because etcd's root go.mod uses local replace directives.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
